/* strata_c.h: a flat C API over strata::OffloadOptimizer (offload/optimizer.h),
 * for trainers written in languages other than C++. Link libstrata_c.so
 * (CMake target strata::capi).
 *
 *   strata_device* dev = NULL;
 *   strata_optimizer* opt = NULL;
 *   if (strata_device_open("host", &dev) != STRATA_OK) die(strata_last_error());
 *   strata_param params[2] = {
 *       {.name = "w", .data = w, .grad = w_grad, .elems = n_w, .group = 0},
 *       {.name = "b", .data = b, .grad = b_grad, .elems = n_b, .group = 1}};
 *   strata_hyper hypers[2] = {{1e-3, 0.9, 0.999, 1e-8, 0.01}, {1e-3, 0.9, 0.999, 1e-8, 0.0}};
 *   const char* config = "{\"zero_optimization\": {\"offload_optimizer\": "
 *                        "{\"device\": \"nvme\", \"nvme_path\": \"/local_nvme\"}}}";
 *   if (strata_optimizer_create(dev, NULL, NULL, config, params, 2, hypers, 2, &opt))
 *     die(strata_last_error());
 *   for (;;) {
 *     backward(loss * strata_optimizer_loss_scale(opt));   // writes w_grad, b_grad
 *     if (strata_optimizer_step(opt) != STRATA_OK) die(strata_last_error());
 *     strata_optimizer_zero_grad(opt);
 *   }
 *   strata_optimizer_free(opt);
 *   strata_device_free(dev);
 *
 * Conventions:
 *   - Every function that can fail returns an int status: STRATA_OK (0) or one
 *     of the codes below (the values of strata::StatusCode). The message of
 *     the last failure on the calling thread is strata_last_error() (""
 *     after a success); it stays valid until the thread's next call into
 *     this API. Bytes of the caller's that are not UTF-8 (in a path, a
 *     name) appear in it as \xNN, so the message is always UTF-8.
 *   - An index past the end (a param, a group) is STRATA_OUT_OF_RANGE.
 *   - Handles are opaque; each *_free accepts NULL. Free the optimizer before
 *     its communicator and device (a device freed first is undefined: it must
 *     outlive everything made on it).
 *   - Tensors (data, grad): device memory of the device, elements of the
 *     config's param dtype ("fp16"/"bf16" sections; fp32 otherwise) and grad
 *     dtype ("strata.grad_dtype"), alive and not moved while the optimizer
 *     lives. On the host device any host memory is accepted (it is read and
 *     written in place). Params are listed in group order: group 0's first,
 *     then group 1's, ... (group numbers non-decreasing).
 *   - Thread-safety: one thread drives an optimizer; different handles may be
 *     used from different threads. A call that returns a status, made on an
 *     optimizer while another thread's call on it runs, is refused with
 *     STRATA_FAILED_PRECONDITION naming the running call (it never runs
 *     beside it). The value getters (loss_scale, step_count, step_state,
 *     last_step, last_step_nonfinite, format_*) may be called from any
 *     thread, never refused: they return the values as of the end of the
 *     last call.
 * The config is the DeepSpeed-style JSON of docs/config.md.
 */
#ifndef STRATA_OFFLOAD_STRATA_C_H_
#define STRATA_OFFLOAD_STRATA_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes (strata::StatusCode). */
enum {
  STRATA_OK = 0,
  STRATA_CANCELLED = 1,
  STRATA_INVALID_ARGUMENT = 3,
  STRATA_NOT_FOUND = 5,
  STRATA_RESOURCE_EXHAUSTED = 8,
  STRATA_FAILED_PRECONDITION = 9,
  STRATA_OUT_OF_RANGE = 11,
  STRATA_UNIMPLEMENTED = 12,
  STRATA_INTERNAL = 13,
  STRATA_UNAVAILABLE = 14,
  STRATA_DATA_LOSS = 15
};

typedef struct strata_device strata_device;
typedef struct strata_comm strata_comm;
typedef struct strata_optimizer strata_optimizer;

/* The message of this thread's last failed call; "" after a success. */
const char* strata_last_error(void);
/* "OK", "InvalidArgument", ...; "Unknown" for other values. */
const char* strata_status_name(int status);
/* "0.2.0". */
const char* strata_version(void);

/* Logging: lines of the levels below go to stderr ("strata: <level>:
 * <message>") unless a callback takes them. The level starts as the
 * environment's STRATA_LOG (debug|info|warning|error|off; default info).
 * strata_set_log_level sets it for the process: STRATA_INVALID_ARGUMENT for
 * a value outside STRATA_LOG_DEBUG..STRATA_LOG_OFF. strata_set_log_callback
 * sends every enabled line to `fn` instead (NULL: back to stderr), with
 * `user` as given, the level and the message (UTF-8, no prefix, no trailing
 * newline; valid during the call only). `fn` is called on whichever thread
 * logs (the library's worker threads too), possibly on several at once, so
 * it must be thread-safe; it may log or change the callback. A callback
 * replaced while it runs finishes that call. */
enum {
  STRATA_LOG_DEBUG = 0,
  STRATA_LOG_INFO = 1,
  STRATA_LOG_WARNING = 2,
  STRATA_LOG_ERROR = 3,
  STRATA_LOG_OFF = 4
};
typedef void (*strata_log_fn)(void* user, int level, const char* message);
int strata_set_log_level(int level);
int strata_log_level(void);
int strata_set_log_callback(strata_log_fn fn, void* user);

/* Devices: "host" (emulated; accepts the caller's host memory as tensors),
 * "cuda:N", or "auto" (cuda:0 where present, else host). */
int strata_device_open(const char* name, strata_device** out);
void strata_device_free(strata_device* device);
/* "host", "cuda:0". Valid while the device lives. */
const char* strata_device_name(const strata_device* device);

/* NCCL communicators: rank 0 makes an id, the trainer sends its 128 bytes to
 * every rank, and every rank calls strata_comm_nccl_create (a collective).
 * STRATA_UNIMPLEMENTED in a build without NCCL. libnccl.so.2 is opened at the
 * first of these calls, not linked (the environment variable
 * STRATA_NCCL_LIBRARY names the file); STRATA_UNAVAILABLE, naming where it
 * looked, when it cannot be loaded. */
enum { STRATA_NCCL_UNIQUE_ID_BYTES = 128 };
int strata_nccl_unique_id(uint8_t id[STRATA_NCCL_UNIQUE_ID_BYTES]);
int strata_comm_nccl_create(strata_device* device, const uint8_t id[STRATA_NCCL_UNIQUE_ID_BYTES],
                            int rank, int world_size, strata_comm** out);
void strata_comm_free(strata_comm* comm);

/* strata_param and strata_hyper are passed in arrays, so their layout is
 * frozen: a later release adds per-param or per-group settings as functions
 * (as strata_optimizer_set_param_shape), never as fields. Structs the
 * library fills (strata_step_stats) grow at their end instead, and their
 * getters take the caller's size. */

/* One trainer tensor. `name` (UTF-8) may be NULL; it is copied. */
typedef struct strata_param {
  const char* name;
  void* data;
  void* grad;
  uint64_t elems;
  uint32_t group;
} strata_param;

/* A param group's hyperparameters. */
typedef struct strata_hyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} strata_hyper;

/* Creates the optimizer (a collective across the ranks of `comm`).
 *   comm:   NULL for one rank.
 *   stream: the trainer's native stream (cudaStream_t on CUDA; the engine's
 *           work that reads or writes the tensors is ordered on it), or
 *           NULL for the device's default stream: on CUDA the legacy
 *           default stream, the same as passing a cudaStream_t of 0, where
 *           kernels launched with no stream run (a trainer compiled with
 *           --default-stream per-thread passes cudaStreamPerThread).
 *   hypers: num_groups entries, or NULL for the config's optimizer values in
 *           every group.
 * STRATA_INVALID_ARGUMENT for a bad config (a key repeated within an object
 * included), bad params or groups (each of the num_groups groups needs a
 * param), or tensors whose memory overlaps (every data and grad must be its
 * own memory); STRATA_RESOURCE_EXHAUSTED when the state does not fit the
 * budgets. */
int strata_optimizer_create(strata_device* device, strata_comm* comm, void* stream,
                            const char* config_json, const strata_param* params, size_t num_params,
                            const strata_hyper* hypers, uint32_t num_groups,
                            strata_optimizer** out);
void strata_optimizer_free(strata_optimizer* opt);

/* The grad of param `index` is complete (optional; lets the reduction start
 * during backward). */
int strata_optimizer_grad_ready(strata_optimizer* opt, uint32_t index);
/* Hands over the gradients of one micro-step (gradient accumulation). */
int strata_optimizer_reduce_gradients(strata_optimizer* opt);
/* One optimizer step; params are updated in place. On CUDA the updates are
 * ordered on the trainer's stream; on the host device the call returns once
 * the params are written. */
int strata_optimizer_step(strata_optimizer* opt);
/* Zeroes the grad tensors (as step orders its writes) and drops gradients
 * not yet consumed: micro-steps handed over by reduce_gradients too (warned
 * once). */
int strata_optimizer_zero_grad(strata_optimizer* opt);
/* Zeroes the grad tensors only: the micro-steps reduce_gradients handed over
 * stay for the next step. Between micro-steps of accumulation, when backward
 * adds into the grad tensors. */
int strata_optimizer_zero_grad_tensors(strata_optimizer* opt);

/* The loss multiplier for the next backward (1 unless fp16 loss scaling). */
double strata_optimizer_loss_scale(const strata_optimizer* opt);
/* Optimizer steps taken (skipped steps not counted). */
int64_t strata_optimizer_step_count(const strata_optimizer* opt);
int strata_optimizer_rank(const strata_optimizer* opt);
int strata_optimizer_world_size(const strata_optimizer* opt);

uint32_t strata_optimizer_num_groups(const strata_optimizer* opt);
int strata_optimizer_get_hyper(const strata_optimizer* opt, uint32_t group, strata_hyper* out);
/* Takes effect at the next step (LR schedules); a retry finishes a failed
 * step with the values it began with. */
int strata_optimizer_set_hyper(strata_optimizer* opt, uint32_t group, const strata_hyper* hyper);
int strata_optimizer_set_lr(strata_optimizer* opt, uint32_t group, double lr);

/* What the last step did (strata::StepStats). Times in seconds. Later
 * versions only append fields, so the struct a caller was compiled with is
 * always a prefix of the library's. */
typedef struct strata_step_stats {
  int64_t step;
  int32_t skipped; /* 1: non-finite gradients, no update */
  double loss_scale;
  double grad_norm;
  float clip_coef;
  uint32_t micro_steps;
  double d2h_sec, comm_sec, read_sec, adam_sec, write_sec, h2d_sec, step_sec;
  double grad_stats_sec; /* until the step's decision (norm, non-finite count; not in adam_sec) */
  double device_sec;     /* device kernels: packing grads, unpacking params */
  uint64_t read_bytes, write_bytes, d2h_bytes, h2d_bytes; /* NVMe, then PCIe */
  uint64_t nonfinite_elems;                               /* NaN/inf gradient elements, all ranks */
  uint64_t resident_bytes;  /* NVMe reads skipped: the extent was still in its buffer */
  uint64_t host_dram_bytes; /* DRAM bytes the CPU read and wrote (28 per param for bf16 Adam) */
} strata_step_stats;
/* The last step's statistics (as of the end of the last call: a value
 * getter, never refused). `out_size`: sizeof(strata_step_stats) as the
 * caller was compiled, at least through `skipped` (STRATA_INVALID_ARGUMENT
 * otherwise). The library writes the fields that fit and zeroes any bytes
 * of a newer caller's struct that it does not know, so callers built
 * against an older or newer header keep working. */
int strata_optimizer_last_step(const strata_optimizer* opt, strata_step_stats* out,
                               size_t out_size);
/* NaN or inf gradient elements the last step saw, over all ranks (what made
 * it skip); 0 for NULL. A value getter. */
uint64_t strata_optimizer_last_step_nonfinite(const strata_optimizer* opt);

/* Text outputs, snprintf-style: write at most `capacity` bytes (with the
 * terminating NUL) to `buf` (may be NULL with capacity 0) and return the
 * length of the whole text. */
/* The last step as one line (strata::FormatStepStats). */
size_t strata_optimizer_format_stats(const strata_optimizer* opt, char* buf, size_t capacity);
/* The placement plan table (what lives where, bytes per tier). */
size_t strata_optimizer_format_plan(const strata_optimizer* opt, char* buf, size_t capacity);

/* A step that fails part way (an IO error on a later sub-group) leaves the
 * optimizer STRATA_STEP_FAILED: some sub-groups hold the next step's values.
 * Until it is resolved, step and save return STRATA_FAILED_PRECONDITION
 * naming the failed step; strata_optimizer_retry_step finishes it with the
 * gradients it kept (bitwise a clean run's; a collective), and
 * strata_optimizer_load replaces the state. Pending gradients are never
 * applied again by a plain step. */
enum { STRATA_STEP_READY = 0, STRATA_STEP_FAILED = 1 };
int strata_optimizer_step_state(const strata_optimizer* opt);
/* The failed step's error (snprintf-style, as the text outputs above); "" while ready. */
size_t strata_optimizer_format_step_failure(const strata_optimizer* opt, char* buf,
                                            size_t capacity);
/* STRATA_FAILED_PRECONDITION when no step failed. */
int strata_optimizer_retry_step(strata_optimizer* opt);

/* Param `index` (registration order) now lives at `data` / `grad`: the
 * trainer replaced its memory (same elements and dtypes). The optimizer
 * never touches the old memory again; call it before the next step or load.
 * STRATA_OUT_OF_RANGE for a bad index; STRATA_INVALID_ARGUMENT for a NULL
 * pointer, or memory that overlaps another tensor's (data == grad included).
 * Allowed while a failed step awaits retry: the retry writes every param to
 * the new memory. */
int strata_optimizer_rebind_param(strata_optimizer* opt, uint32_t index, void* data, void* grad);
/* Several params at once, all or none, checked as they are after every move:
 * when the trainer reallocates many tensors, one's new memory may be where
 * another's old memory was, which one-by-one rebinds would refuse.
 * STRATA_INVALID_ARGUMENT also for an index given twice. */
typedef struct strata_binding {
  uint32_t index;
  void* data;
  void* grad;
} strata_binding;
int strata_optimizer_rebind_params(strata_optimizer* opt, const strata_binding* bindings,
                                   size_t count);

/* Values the trainer wrote into params after create (weights loaded late,
 * an edit) become the master weights; without this call the next step
 * writes every param from the old ones. Each element whose value differs
 * from its master weight cast to the param dtype takes the param's value;
 * the others keep their fp32 master, and the moments stay (DeepSpeed's
 * refresh_fp32_params, without rounding what was not written). `indices`:
 * `count` registration indices, or NULL and 0 for every param. Reads the
 * params in order on the trainer's stream. Not a collective: each rank
 * adopts its own shard, so every rank must hold the same values.
 * `adopted` (may be NULL): elements changed on this rank.
 * STRATA_OUT_OF_RANGE for a bad index; STRATA_FAILED_PRECONDITION while a
 * failed step awaits its retry. */
int strata_optimizer_reload_params(strata_optimizer* opt, const uint32_t* indices, size_t count,
                                   uint64_t* adopted);

/* The shape of param `index` (`ndim` dims whose product is its elems; 0 dims:
 * a scalar), recorded by later saves and checked by later loads, so exports
 * (`strata export`) hold shaped tensors. STRATA_INVALID_ARGUMENT when the
 * product differs from the param's elems. Params without one are [elems].
 * An optimizer given no shapes takes those of the save it loads, so a resumed
 * run need not set them again. */
int strata_optimizer_set_param_shape(strata_optimizer* opt, uint32_t index, const uint64_t* dims,
                                     uint32_t ndim);

/* The step trace (docs/c_api.md): when each stage of each sub-group ran, as
 * Chrome trace JSON for https://ui.perfetto.dev or scripts/plot_trace.py.
 * steps > 0 starts recording into an empty ring that keeps (at least) the
 * newest `steps` steps; 0 stops recording (what was recorded stays until the
 * next start). Off, the engine pays one relaxed load per event.
 * STRATA_INVALID_ARGUMENT for steps < 0 or above 1000 (a longer timeline is
 * more than a viewer shows, and the ring is allocated up front);
 * STRATA_RESOURCE_EXHAUSTED when the ring does not fit in memory. Either way
 * recording stops and the ring keeps what it holds. Call between steps. */
int strata_optimizer_trace_enable(strata_optimizer* opt, int steps);
/* Writes what the ring holds to `path` (through a temporary file and a
 * rename); recording goes on if it was on. otherData holds "rank",
 * "world_size", "params" (elements of all tensors), "step_count" and the
 * members of `other_data_json`, a JSON object (may be NULL); its keys win.
 * Each rank writes its own file: give each a different path.
 * STRATA_INVALID_ARGUMENT for other_data_json that is not valid JSON or not
 * an object;
 * when the file cannot be written, the IO error's status (STRATA_NOT_FOUND
 * for a missing directory) with a message that names the path. */
int strata_optimizer_trace_write(strata_optimizer* opt, const char* path,
                                 const char* other_data_json);

/* Checkpoints (docs/checkpoint.md): a collective; every rank passes the same
 * directory. A load returns once the params are written (host device) or
 * ordered on the stream (CUDA). */
int strata_optimizer_save(strata_optimizer* opt, const char* dir);
int strata_optimizer_load(strata_optimizer* opt, const char* dir);

/* The weights of the checkpoint in `dir` as safetensors (`strata export`):
 * dtype "fp32", "bf16" or "fp16"; `out` a .safetensors file, or a directory
 * (Hugging Face shards and an index when max_shard_bytes > 0). force != 0
 * replaces existing output files. STRATA_FAILED_PRECONDITION for an output
 * inside the checkpoint, one that exists (without force) or is not a
 * regular file. */
int strata_checkpoint_export(const char* dir, const char* out, const char* dtype,
                             uint64_t max_shard_bytes, int force);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_OFFLOAD_STRATA_C_H_ */
