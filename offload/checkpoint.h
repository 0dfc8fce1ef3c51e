// Checkpoints of an OffloadOptimizer: save, load (with resharding N -> M
// ranks), inspect and export to safetensors. The format is tier-independent
// (the same checkpoint loads whether the state then lives in DRAM or on NVMe)
// and is described precisely in docs/checkpoint.md; in short:
//
//   DIR/latest.json                      which save is current (atomic rename)
//   DIR/step-0000000012-<id>/            one directory per save
//     rank00000.json                     manifest of rank 0 (layout, step, scaler,
//                                        hyperparameters, files, checksums)
//     rank00000.master.f32               rank 0's shard of the flat fp32 master
//     rank00000.exp_avg.f32              ... and of each optimizer moment
//     rank00000.exp_avg_sq.f32
//
//   STRATA_RETURN_IF_ERROR(opt->Save("/ckpt/run1"));          // every rank
//   ... process restarts, maybe with another world size ...
//   STRATA_RETURN_IF_ERROR(opt->Load("/ckpt/run1"));          // every rank
//   STRATA_RETURN_IF_ERROR(ExportSafetensors("/ckpt/run1", "/out/model.safetensors").status());
//
// Durability: every file goes through AtomicFileWriter (runtime/atomic_file.h:
// a unique temporary name in the target directory, fsync, rename, directory
// fsync; the temporary removed on failure). Data files and each rank's
// manifest go into the save's own directory (not yet referenced by
// anything); after every rank finished, rank 0 publishes the save by
// replacing latest.json. A crash at any point leaves the previous
// latest.json, and the save it names, intact. Rank 0 holds DIR/strata-save.lock
// (runtime/file_lock.h) from before the first byte until retention is done,
// so a second job saving into DIR fails at once with the holder's pid.
// Retention: after publishing, rank 0 keeps the newest `keep_checkpoints`
// saves latest.json lists (at least 2: the new one and the one before it)
// and the save the optimizer last loaded from, until as many saves have
// followed it into DIR (a rollback's new line replaces it before it goes),
// and removes the other save
// directories of its own (named step-<10 digits>-<12 hex digits> and holding
// only a save's files) that it can account for: the leftovers of saves that
// crashed, and the saves the previous latest.json listed. A complete save it
// cannot account for (not listed, of a later step, or every listed save
// missing) is kept with a warning; anything else in DIR, the user's step-*
// files included, stays.
//
// Every reader (load, export, `strata inspect --verify`) applies one
// validator to the manifests: format version, one save, a consistent layout,
// shapes that match the element counts, hyperparameters and loss-scaler
// state in range. Load then compares the model (the same tensors, sizes,
// shapes where both sides know them, and groups) and verifies every
// checksum of every data file it reads; only when all of that holds on every
// rank does it write the state, the counters and the hyperparameters, and
// recompute the trainer's param tensors from the loaded master weights. Into
// a new optimizer (state_from_params() on every rank: nothing to lose, since
// ResetStateFromParams writes that state again) it reads each file once,
// every chunk checked as it arrives, and a failure on any rank resets every
// rank's state as Create wrote it.
//
// Save writes the committed state: it refuses (FailedPrecondition, nothing
// written) while the optimizer is in StepState::kFailed, whose sub-groups
// mix two steps.
//
// Errors name the file and say what to do: NotFound (no checkpoint, missing
// file), FailedPrecondition (another model, a world size other than the
// save's with Reshard::kForbid, an unsupported format version, a failed
// step, a save of another job running in DIR, an output that exists or is
// not a regular file), DataLoss (checksum mismatch, truncated file, a
// manifest that is unreadable or fails the validator), and the IO errors of
// the storage. Thread-safety: Save/Load are collectives driven by each
// rank's thread; a CheckpointReader is driven by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "offload/layout.h"
#include "offload/loss_scaler.h"
#include "offload/optimizer.h"
#include "runtime/atomic_file.h"
#include "runtime/dtype.h"
#include "runtime/log.h"
#include "runtime/status.h"
#include "runtime/storage.h"

namespace strata {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr std::string_view kCheckpointFormatName = "strata-checkpoint";

// The shape of each registered param (flat over groups, registration order),
// as the trainer knows it: the engine itself knows element counts only. An
// empty list: no shapes (a tensor is then read as 1-D [elems]).
using TensorShapes = std::vector<std::vector<uint64_t>>;

// The largest chunk_bytes a save writes and a reader takes (256 MiB). A
// chunk is one IO request and the unit a checksum names; drives reach their
// rate with requests of a few MiB, so larger chunks buy nothing, while every
// reader holds queue_depth + 1 of them per array (2.25 GiB per array at
// 256 MiB and the default depth) and a writer queue_depth per file. A larger
// value (a typo, a crafted manifest) failed an allocation and aborted.
inline constexpr uint64_t kMaxCheckpointChunkBytes = uint64_t{256} << 20;

struct SaveOptions {
  Storage* storage = nullptr;  // nullptr: io_uring (posix fallback)
  // IO and checksum unit: a multiple of 4096, at most kMaxCheckpointChunkBytes.
  uint64_t chunk_bytes = 1 << 20;
  uint32_t queue_depth = 8;           // chunk writes in flight per file
  DirectIo direct = DirectIo::kAuto;  // data files: O_DIRECT where the filesystem allows
  uint32_t keep_checkpoints = 2;      // saves kept after publishing (values < 2 mean 2)
  TensorShapes shapes{};              // recorded in the manifest; each product == elems
};

enum class Reshard : uint8_t {
  kAllow,   // a checkpoint of N ranks loads into M ranks
  kForbid,  // FailedPrecondition when the world sizes differ
};

struct LoadOptions {
  Storage* storage = nullptr;
  uint32_t queue_depth = 8;
  DirectIo direct = DirectIo::kAuto;
  Reshard reshard = Reshard::kAllow;
  TensorShapes shapes{};  // when given, a saved shape must equal it (not just the elems)
  // When set, receives the shapes the loaded save recorded (empty when it
  // recorded none) once the load succeeds: a front end that was given no
  // shapes (the C API's trainer before strata_optimizer_set_param_shape)
  // keeps them for its next save, so a resumed run still exports shaped.
  TensorShapes* saved_shapes = nullptr;
};

// Save/Load with options; OffloadOptimizer::Save/Load use the defaults.
Status SaveCheckpoint(OffloadOptimizer& opt, const std::string& dir,
                      const SaveOptions& options = {});
Status LoadCheckpoint(OffloadOptimizer& opt, const std::string& dir,
                      const LoadOptions& options = {});

// ---- Reading without an optimizer (inspect, export, reshard) ----------------

struct CheckpointTensor {
  std::string name;  // as registered; "" when none
  uint32_t group = 0;
  uint64_t offset_elems = 0;  // in the flat buffer of the save
  uint64_t elems = 0;
  // The trainer's shape (product == elems; {} is a scalar); nullopt when the
  // save recorded none (read it as [elems]).
  std::optional<std::vector<uint64_t>> shape{};
};

struct CheckpointFile {
  std::string array;                 // "master", "exp_avg", ...
  std::string name;                  // file name inside the save directory
  uint64_t payload_bytes = 0;        // shard_elems x 4: the fp32 values
  uint64_t file_bytes = 0;           // payload rounded up to 4096 (zero padding)
  uint64_t xxh3 = 0;                 // XXH3-64 (seed 0) of the whole file
  std::vector<uint64_t> chunk_xxh3;  // of each chunk_bytes piece of the file
};

struct RankManifest {
  uint32_t rank = 0;
  ElemRange shard;
  std::vector<CheckpointFile> files;  // one per array, in array order
};

struct CheckpointInfo {
  std::string root;      // the directory given
  std::string save_dir;  // the save that was opened (root/step-...)
  std::string save_id;   // "step-0000000012-<id>"
  int format_version = 0;
  int64_t step = 0;
  uint32_t world_size = 0;
  std::string optimizer;            // "AdamW", ...
  std::vector<std::string> arrays;  // "master", then the moments
  std::string param_dtype;          // the trainer's dtype at save time
  uint64_t align_elems = 0;
  uint64_t total_elems = 0;
  uint64_t shard_elems = 0;
  uint64_t tensor_elems = 0;
  uint64_t chunk_bytes = 0;
  std::vector<CheckpointTensor> tensors;
  std::vector<GroupHyper> groups;
  LossScalerState scaler;
  std::vector<RankManifest> ranks;
  uint64_t data_bytes() const;  // sum of the data files' sizes
};

// The array names of an optimizer's state, master first.
std::vector<std::string> StateArrayNames(OptimizerType type);

// A checkpoint whose tensors are keyed alike: two of one non-empty name, or
// a name equal to "param.<i>", which unnamed tensor i is given (saves made
// before OffloadOptimizer::Create refused such names). A state_dict or an
// export keyed by name would keep only one of them.
enum class DuplicateNames : uint8_t {
  kRefuse,  // FailedPrecondition naming both tensors (state_dict, export)
  kAllow,   // tensors are used by index (Load, inspect)
};

struct ReaderOptions {
  Storage* storage = nullptr;
  uint32_t queue_depth = 8;  // chunk reads in flight per array, taken within [1, 64]
  DirectIo direct = DirectIo::kAuto;
  DuplicateNames duplicate_names = DuplicateNames::kRefuse;
  // Verify checks the arrays on threads of their own, at most this many
  // (<= 0: one per array, up to the hardware's threads; 1: one thread).
  int threads = 0;
  // Verify's progress lines on the log (work of more than ~2 s, as save
  // and load): "<verify_what>: 1.20 GiB of 4.30 GiB (27%), ..."; empty:
  // "verify <save directory>".
  std::string verify_what{};
  ProgressOptions progress{};
};

// Reads a checkpoint: the save latest.json names (or DIR itself when it is a
// save directory), every rank's manifest, checked for consistency on Open.
// Data reads verify each chunk's checksum as it arrives. A read leaves the
// file's next chunks in flight (up to queue_depth): a read that goes on
// where it ended finds them read ahead. Host memory: queue_depth + 1
// chunks per array read (ResourceExhausted, naming them, when they cannot
// be had). Open files: at most one data file per array at a
// time, whatever the number of ranks (a read of another rank's file closes
// the array's previous one). Reads of different arrays may run on different
// threads at once; one array's may not.
class CheckpointReader {
 public:
  static Result<std::unique_ptr<CheckpointReader>> Open(const std::string& dir,
                                                        const ReaderOptions& options = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const CheckpointInfo& info() const { return info_; }

  // Flat elements [range) of array `array` of the save's layout, across the
  // ranks' shards. OutOfRange past total_elems.
  Status ReadFlat(uint32_t array, ElemRange range, std::span<float> out);
  // Elements [offset_elems, + out.size()) of tensor `tensor`.
  Status ReadTensor(uint32_t array, uint32_t tensor, uint64_t offset_elems, std::span<float> out);
  // Opens every data file of `ranks` (all when empty), one at a time, and
  // checks its size against the manifest, reading nothing: NotFound (missing) or DataLoss
  // (truncated, longer) naming the file. `strata inspect` without --verify.
  Status CheckFiles(std::span<const uint32_t> ranks = {});
  // Reads every byte of the data files of `ranks` (all when empty) and checks
  // sizes, chunk checksums and whole-file checksums. DataLoss naming the file.
  Status Verify(std::span<const uint32_t> ranks = {});

 private:
  struct Impl;
  CheckpointReader(CheckpointInfo info, std::unique_ptr<Impl> impl);
  CheckpointInfo info_;
  std::unique_ptr<Impl> impl_;
};

struct ExportOptions {
  ReaderOptions reader{};
  // F32, BF16 (round to nearest even, as the engine writes bf16 params) or F16.
  DType dtype = DType::kF32;
  // 0: one file. Otherwise the output is a directory in the Hugging Face
  // layout: model-00001-of-0000N.safetensors, each with at most this many
  // bytes of tensor data (a larger tensor gets a file of its own), and
  // model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}).
  uint64_t max_shard_bytes = 0;
  // An output file that exists: kRefuse (FailedPrecondition) or kReplace
  // (--force). The same for the files of an earlier export in a directory
  // output that this one would not replace (the other layout, or shards of
  // another count): kReplace removes them (ExportResult::removed).
  ExistingFile existing = ExistingFile::kRefuse;
  Storage* storage = nullptr;        // for the output files; nullptr: posix
  // Host memory for the copy: two halves, the next part read into one
  // while the other is converted and written.
  uint64_t buffer_bytes = 32 << 20;
  // Polled once per part (buffer_bytes / 2); true stops the export (Cancelled).
  // A front end's Ctrl-C (the Python module checks its signals here).
  std::function<bool()> interrupted{};
};

struct ExportResult {
  std::vector<std::string> files;  // written, the index (if any) last
  // Files of an earlier export into the same directory in another layout (or
  // shard count), removed with kReplace so that loaders see only this one.
  std::vector<std::string> removed;
  uint64_t tensor_bytes = 0;       // tensor data, all files
  uint64_t tensors = 0;
};

// Writes the full master weights of the checkpoint in `dir` as safetensors,
// one tensor per registered param, named as registered ("param.<i>" when
// unnamed), shaped as saved (1-D when the save has no shapes), in
// registration order, with __metadata__ {"format": "pt", "step",
// "world_size", "optimizer", "source"}: what torch's load_state_dict takes.
// `out` ending in ".safetensors" is one file; anything else is a directory
// (created when missing) that receives model.safetensors, or the shards and
// the index with max_shard_bytes. Streams: host memory stays at
// buffer_bytes plus the reader's chunks, whatever the model's size.
// Refuses (FailedPrecondition, before writing anything) an output inside the
// checkpoint directory, an existing output file unless kReplace, and any
// output that is not a regular file; InvalidArgument for an empty `out`, a
// dtype other than F32/BF16/F16 or max_shard_bytes with a ".safetensors"
// file; NotFound when the directory of a ".safetensors" `out` is missing;
// FailedPrecondition for duplicate names, and (without kReplace) for a
// directory `out` holding an earlier export's files in another layout,
// which loaders would read instead of this export (model.safetensors before
// an index). Each file is written atomically; stale files are removed after
// the data files and before the index are written. A failure or an
// interruption leaves nothing of this export: the file being written is
// removed, and so are the shards written before it.
Result<ExportResult> ExportSafetensors(const std::string& dir, const std::string& out,
                                       const ExportOptions& options = {});

}  // namespace strata
