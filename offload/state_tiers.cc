#include "offload/state_tiers.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "runtime/machine.h"

namespace strata::internal {

Result<std::unique_ptr<StateTiers>> StateTiers::Create(const StateTiersOptions& options) {
  std::unique_ptr<StateTiers> t(new StateTiers(options));
  STRATA_RETURN_IF_ERROR(t->Init());
  return t;
}

StateTiers::~StateTiers() {
  DrainReads();
  for (auto& w : writes_) {
    if (w.valid()) w.get().IgnoreError();
  }
  io_.reset();
}

Status StateTiers::Init() {
  constexpr std::string_view kOp = "create offload optimizer";
  Device& dev = *o_.device;
  const uint32_t n = static_cast<uint32_t>(o_.sub_groups.size());
  uint64_t max_elems = 0;  // of the sub-groups not on the device
  for (uint32_t i = 0; i < n; ++i) {
    if (o_.plan->sub_groups[i].tier != Tier::kDevice) {
      max_elems = std::max(max_elems, o_.sub_groups[i].elems());
    }
  }
  extent_.assign(n, -1);
  host_.resize(n);
  std::vector<uint32_t> in_dram;
  std::vector<uint64_t> dram_bytes;
  uint64_t device_elems = 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (o_.plan->sub_groups[i].tier == Tier::kDevice) {
      if (i != device_count_) return InternalError("state tiers: device sub-groups must come first");
      device_offset_.push_back(device_elems);
      device_elems += o_.sub_groups[i].elems();
      ++device_count_;
    } else if (o_.plan->sub_groups[i].tier == Tier::kNvme) {
      extent_[i] = static_cast<int32_t>(nvme_order_.size());
      nvme_order_.push_back(i);
    } else {
      in_dram.push_back(i);
      dram_bytes.push_back(o_.sub_groups[i].elems() * o_.arrays * 4);
    }
  }
  if (device_elems > 0) {
    STRATA_ASSIGN_OR_RETURN(device_state_, dev.Allocate(device_elems * o_.arrays * 4));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<PinnedBuffer> dram, AllocatePinned(dev, dram_bytes));
  for (size_t k = 0; k < in_dram.size(); ++k) host_[in_dram[k]] = std::move(dram[k]);
  // With no state on NVMe, nvme_path is still this optimizer's while it
  // lives (made, and locked as a store locks it): a second optimizer on it
  // fails whatever either plan puts there.
  if (nvme_order_.empty() && o_.config->device != OffloadDevice::kNvme) return OkStatus();
  Storage* storage = o_.storage;
  if (storage == nullptr) {
    // The engine's own storage is the filesystem: missing nvme_path folders
    // are made, as DeepSpeed does.
    for (const std::string& dir : o_.config->nvme_paths) {
      STRATA_RETURN_IF_ERROR(CreateDirectories(dir));
    }
    STRATA_ASSIGN_OR_RETURN(owned_storage_, CreateStorage({}));
    storage = owned_storage_.get();
  }
  const OffloadConfig& c = *o_.config;
  if (nvme_order_.empty()) {
    STRATA_ASSIGN_OR_RETURN(dir_locks_, LockStateDirectories(*storage, c.nvme_paths, o_.rank));
    return OkStatus();
  }
  STRATA_ASSIGN_OR_RETURN(store_,
                          StateStore::Create(*storage, {.paths = c.nvme_paths,
                                                        .rank = o_.rank,
                                                        .extent_bytes = max_elems * o_.arrays * 4,
                                                        .num_extents = nvme_count(),
                                                        .block_bytes = c.aio.block_bytes,
                                                        .queue_depth = c.aio.queue_depth,
                                                        .close = StoreClose::kRemove,
                                                        .parallel_for = ParallelFor()}));
  const uint32_t k = std::max<uint32_t>(1, std::min(o_.nvme_buffers, nvme_count()));
  std::vector<std::span<std::byte>> spans;
  for (uint32_t b = 0; b < k; ++b) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer pb, AllocatePinned(dev, store_->ExtentBufferBytes()));
    std::memset(pb.data(), 0, pb.size_bytes());
    spans.push_back(pb.bytes().first(store_->ExtentBufferBytes()));
    buffers_.push_back(std::move(pb));
  }
  STRATA_RETURN_IF_ERROR((store_->RegisterBuffers(spans)).WithContext(kOp));
  io_ = std::make_unique<IoPump>(*store_);
  reads_.resize(nvme_count());
  writes_.resize(nvme_count());
  holds_.assign(buffers_.size(), -1);
  writing_.assign(buffers_.size(), -1);
  return OkStatus();
}

std::function<void(size_t, const std::function<void(size_t, size_t)>&)> StateTiers::ParallelFor()
    const {
  if (o_.cpu == nullptr) return {};
  CpuAdam* cpu = o_.cpu;
  return [cpu](size_t n, const std::function<void(size_t, size_t)>& body) {
    cpu->ParallelFor(n, 1, body);
  };
}

std::string StateTiers::Name(uint32_t i) const {
  if (on_device(i)) return fmt::format("sub-group {} (device)", i);
  return on_nvme(i) ? fmt::format("sub-group {} (nvme extent {})", i, extent_[i])
                    : fmt::format("sub-group {} (host)", i);
}

std::span<float> StateTiers::HostState(uint32_t i) const {
  return host_[i].as<float>().first(o_.sub_groups[i].elems() * o_.arrays);
}

std::span<std::byte> StateTiers::Buffer(uint32_t i) const {
  return buffers_[BufferIndex(i)].bytes().first(store_->ExtentBufferBytes());
}

void StateTiers::WriteDone(uint32_t i, const Status& s) {
  const uint32_t b = BufferIndex(i);
  if (writing_[b] != extent_[i]) return;  // the buffer changed after the write was queued
  writing_[b] = -1;
  holds_[b] = s.ok() ? extent_[i] : -1;
}

std::span<float> StateTiers::NvmeState(uint32_t i) const {
  auto payload = store_->Payload(Buffer(i));
  return {reinterpret_cast<float*>(payload.data()), o_.sub_groups[i].elems() * o_.arrays};
}

std::future<Status> StateTiers::Job(IoOp op, uint32_t i, uint64_t payload_hash) {
  const uint32_t extent = static_cast<uint32_t>(extent_[i]);
  std::span<std::byte> buf = Buffer(i);
  TraceContext* trace = o_.trace;
  const int64_t step = trace->step;
  return io_->Submit(
      {.op = op,
       .extent = extent,
       .buffer = buf,
       .payload_hash = payload_hash,
       .slot = extent % static_cast<uint32_t>(buffers_.size()),
       .on_done = [this, op, i, buf, trace, step](uint64_t begin_ns, uint64_t end_ns,
                                                  Status s) -> Status {
         const bool read = op == IoOp::kRead;
         if (trace->on()) {
           trace->recorder->Record({.name = read ? "read" : "write",
                                    .tier = "nvme",
                                    .begin_ns = begin_ns,
                                    .end_ns = end_ns,
                                    .bytes = buf.size(),
                                    .step = step,
                                    .rank = trace->rank,
                                    .sub_group = static_cast<int32_t>(i),
                                    .track = read ? TraceTrack::kNvmeRead : TraceTrack::kNvmeWrite});
         }
         {
           std::lock_guard<std::mutex> lock(mu_);
           (read ? figures_.read_sec : figures_.write_sec) += (end_ns - begin_ns) * 1e-9;
           if (s.ok()) (read ? figures_.read_bytes : figures_.write_bytes) += buf.size();
         }
         return std::move(s).WithContext(
             fmt::format("{} the state of {}", read ? "read" : "write", Name(i)));
       }});
}

void StateTiers::StartRead(uint32_t i) {
  if (!on_nvme(i) || reads_[extent_[i]].valid() || Resident(i)) return;
  Release(i);
  reads_[extent_[i]] = Job(IoOp::kRead, i);
}

Result<std::span<float>> StateTiers::Acquire(uint32_t i) {
  if (on_device(i)) {
    return InternalError(fmt::format("state tiers: {} has no host state to acquire", Name(i)));
  }
  if (!on_nvme(i)) return HostState(i);
  if (Resident(i)) {  // no read
    Release(i);
    std::lock_guard<std::mutex> lock(mu_);
    figures_.resident_bytes += Buffer(i).size();
    return NvmeState(i);
  }
  StartRead(i);
  STRATA_RETURN_IF_ERROR(reads_[extent_[i]].get());
  // The payload's checksum, here rather than on the IO thread: this thread
  // is about to read the extent anyway, and the IO thread keeps the drive busy.
  STRATA_RETURN_IF_ERROR(store_->VerifyPayload(static_cast<uint32_t>(extent_[i]), Buffer(i))
                             .WithContext(fmt::format("read the state of {}", Name(i))));
  return NvmeState(i);
}

void StateTiers::StartWrite(uint32_t i) {
  if (!on_nvme(i)) return;
  auto& w = writes_[extent_[i]];
  if (w.valid()) w.get().IgnoreError();  // a retry's second write; the first was reported
  w = Job(IoOp::kWrite, i, store_->PayloadHash(Buffer(i)));  // hashed while the data is hot
  holds_[BufferIndex(i)] = -1;
  writing_[BufferIndex(i)] = extent_[i];
}

Status StateTiers::WaitWrite(uint32_t i) {
  if (!on_nvme(i) || !writes_[extent_[i]].valid()) return OkStatus();
  Status s = writes_[extent_[i]].get();
  WriteDone(i, s);
  return s;
}

Status StateTiers::Fill(uint32_t i, const std::function<Status(std::span<float>)>& fill) {
  if (on_device(i)) {
    return InternalError(fmt::format("state tiers: {} is set by Write, not filled", Name(i)));
  }
  if (!on_nvme(i)) return fill(HostState(i));
  // The extent that used this buffer last: its write must be done.
  const uint32_t e = static_cast<uint32_t>(extent_[i]);
  if (e >= buffers_.size()) STRATA_RETURN_IF_ERROR(WaitWrite(nvme_order_[e - buffers_.size()]));
  Release(i);
  STRATA_RETURN_IF_ERROR(fill(NvmeState(i)));  // the extent keeps its committed generation
  StartWrite(i);
  return OkStatus();
}

Status StateTiers::FinishWrites(const std::function<void(uint32_t, const Status&)>& done) {
  Status first;
  for (uint32_t k = 0; k < writes_.size(); ++k) {
    if (!writes_[k].valid()) continue;
    Status s = writes_[k].get();
    WriteDone(nvme_order_[k], s);
    done(nvme_order_[k], s);
    if (!s.ok() && first.ok()) first = std::move(s);
  }
  return first;
}

void StateTiers::DrainReads() {
  for (auto& r : reads_) {
    if (r.valid()) r.get().IgnoreError();
  }
}

void StateTiers::ReadAhead(uint32_t i, bool reverse) {
  // nvme_order_ is in index order; consecutive extents have distinct buffers.
  const auto k = static_cast<ptrdiff_t>(buffers_.size());
  if (reverse) {
    const auto end = std::find_if(nvme_order_.begin(), nvme_order_.end(),
                                  [i](uint32_t sub_group) { return sub_group > i; });
    const auto first = end - std::min<ptrdiff_t>(k, end - nvme_order_.begin());
    for (auto it = end; it != first;) StartRead(*--it);
    return;
  }
  const auto first = std::find_if(nvme_order_.begin(), nvme_order_.end(),
                                  [i](uint32_t sub_group) { return sub_group >= i; });
  const auto last = first + std::min<ptrdiff_t>(k, nvme_order_.end() - first);
  for (auto it = first; it != last; ++it) StartRead(*it);
}

Status StateTiers::Read(uint32_t i, std::span<float> out) {
  if (on_device(i)) return CopyDeviceState(out.data(), DeviceState(i), out.size_bytes(),
                                            CopyKind::kDeviceToHost);
  const uint64_t elems = o_.sub_groups[i].elems();
  for (uint32_t a = 0; a < o_.arrays; ++a) {
    STRATA_RETURN_IF_ERROR(Read(i, a, 0, out.subspan(a * elems, elems)));
  }
  return OkStatus();
}

Result<std::span<const float>> StateTiers::View(uint32_t i) {
  if (on_device(i)) {
    return InternalError(fmt::format("state tiers: {} has no host state to view", Name(i)));
  }
  if (!on_nvme(i)) return HostState(i);
  STRATA_ASSIGN_OR_RETURN(std::span<const float> s, Committed(i));
  return s;
}

Result<std::span<float>> StateTiers::Committed(uint32_t i) {
  if (!Resident(i)) {
    STRATA_RETURN_IF_ERROR(Acquire(i).status());
    // Read and verified, and not changed: the buffer holds i's committed copy.
    holds_[BufferIndex(i)] = extent_[i];
  }
  return NvmeState(i);
}

Status StateTiers::DevicePieces(
    uint32_t i, uint32_t array, uint64_t piece_elems,
    const std::function<Status(uint64_t, float*, std::span<float>)>& each) {
  const uint64_t elems = o_.sub_groups[i].elems();
  std::vector<float> piece(std::min(elems, std::max<uint64_t>(piece_elems, 1)));
  for (uint64_t begin = 0; begin < elems; begin += piece.size()) {
    const std::span<float> p = std::span(piece).first(std::min(piece.size(), elems - begin));
    STRATA_RETURN_IF_ERROR(each(begin, DeviceState(i) + array * elems + begin, p));
  }
  return OkStatus();
}

Status StateTiers::Read(uint32_t i, uint32_t array, uint64_t begin, std::span<float> out) {
  const uint64_t at = array * o_.sub_groups[i].elems() + begin;
  if (on_device(i)) {
    return CopyDeviceState(out.data(), DeviceState(i) + at, out.size_bytes(),
                           CopyKind::kDeviceToHost);
  }
  std::span<const float> s = HostState(i);
  if (on_nvme(i)) {
    STRATA_ASSIGN_OR_RETURN(s, Committed(i));
  }
  std::copy_n(s.begin() + at, out.size(), out.begin());
  return OkStatus();
}

Status StateTiers::ForEachArray(bool concurrent,
                                const std::function<Status(uint32_t array)>& fn) const {
  if (!concurrent || o_.cpu == nullptr) {
    for (uint32_t a = 0; a < o_.arrays; ++a) STRATA_RETURN_IF_ERROR(fn(a));
    return OkStatus();
  }
  std::vector<Status> results(o_.arrays);
  o_.cpu->ParallelFor(o_.arrays, 1, [&](size_t begin, size_t count) {
    for (size_t a = begin; a < begin + count; ++a) results[a] = fn(static_cast<uint32_t>(a));
  });
  for (Status& s : results) {
    if (!s.ok()) return std::move(s);
  }
  return OkStatus();
}

Status StateTiers::Write(uint32_t i, const StateFill& fill, uint64_t piece_elems,
                         StateWriteMode mode) {
  if (on_device(i)) {
    for (uint32_t a = 0; a < o_.arrays; ++a) {
      STRATA_RETURN_IF_ERROR(
          DevicePieces(i, a, piece_elems, [&](uint64_t begin, float* dev, std::span<float> p) {
            STRATA_RETURN_IF_ERROR(fill(a, begin, p));
            return CopyDeviceState(dev, p.data(), p.size_bytes(), CopyKind::kHostToDevice);
          }));
    }
    return OkStatus();
  }
  const uint64_t elems = o_.sub_groups[i].elems();
  STRATA_RETURN_IF_ERROR(Fill(i, [&](std::span<float> s) -> Status {
    return ForEachArray(mode.concurrent_arrays,
                        [&](uint32_t a) { return fill(a, 0, s.subspan(a * elems, elems)); });
  }));
  return mode.wait ? WaitWrite(i) : OkStatus();
}

Status StateTiers::Update(uint32_t i, uint32_t array, const StateUpdate& update,
                          uint64_t piece_elems) {
  const uint64_t elems = o_.sub_groups[i].elems();
  if (on_device(i)) {
    return DevicePieces(
        i, array, piece_elems, [&](uint64_t begin, float* dev, std::span<float> p) -> Status {
          STRATA_RETURN_IF_ERROR(
              CopyDeviceState(p.data(), dev, p.size_bytes(), CopyKind::kDeviceToHost));
          STRATA_ASSIGN_OR_RETURN(const bool changed, update(begin, p));
          if (!changed) return OkStatus();
          return CopyDeviceState(dev, p.data(), p.size_bytes(), CopyKind::kHostToDevice);
        });
  }
  if (!on_nvme(i)) return update(0, HostState(i).subspan(array * elems, elems)).status();
  STRATA_ASSIGN_OR_RETURN(std::span<float> s, Committed(i));
  Result<bool> changed = update(0, s.subspan(array * elems, elems));
  if (!changed.ok() || *changed) Release(i);  // the buffer is no longer the committed copy
  if (!changed.ok()) return changed.status();
  if (!*changed) return OkStatus();
  StartWrite(i);
  return WaitWrite(i);
}

Status StateTiers::CopyDeviceState(void* dst, const void* src, size_t bytes, CopyKind kind) {
  STRATA_RETURN_IF_ERROR(o_.device->CopyAsync(dst, src, bytes, kind, o_.device_stream));
  return o_.device->StreamSynchronize(o_.device_stream);
}

TierFigures StateTiers::TakeFigures() {
  std::lock_guard<std::mutex> lock(mu_);
  TierFigures f = figures_;
  figures_ = TierFigures{};
  if (io_) f.busy_sec = io_->TakeBusySec();
  return f;
}

}  // namespace strata::internal
