// Command execution: validation, the backend op, and the copies around it.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "controller/controller_impl.h"
#include "controller/queue_poller.h"

namespace gdkv {

Command::Command() = default;
Command::~Command() = default;

namespace {

using nvme::Status;

constexpr const char* kOpNames[ReactorStats::kOps] = {
    "store", "retrieve", "list", "delete", "exist", "prefetch", "scatter_retrieve"};
constexpr uint8_t kNoOp = 0xFF;
constexpr uint32_t kMaxListKeys = 65536;
constexpr uint32_t kMaxPrefetchBytes = 64 * 1024;
constexpr size_t kKeepStagingBytes = 1 << 20;  // staging larger than this is freed after use

uint8_t op_index(uint8_t opcode) {
  switch (static_cast<nvme::Opcode>(opcode)) {
    case nvme::Opcode::kStore:
      return 0;
    case nvme::Opcode::kRetrieve:
      return 1;
    case nvme::Opcode::kList:
      return 2;
    case nvme::Opcode::kDelete:
      return 3;
    case nvme::Opcode::kExist:
      return 4;
    case nvme::Opcode::kPrefetch:
      return 5;
    case nvme::Opcode::kScatterRetrieve:
      return 6;
  }
  return kNoOp;
}

void bump(std::atomic<uint64_t>& a, uint64_t by = 1) {
  a.store(a.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

CommandState& state_of(Command* cmd) { return *cmd->state; }

// Appends copies that spread `n` bytes from `src` over `segs` (stopping when either runs out).
// `src_region`: the region id of the source (CopySegment), 0 if none.
void add_spread(CommandState& st, const std::byte* src, size_t n, const DataSegments& segs,
                uint64_t src_region = 0) {
  for (const DataSegment& s : segs) {
    if (n == 0) break;
    size_t take = std::min(n, s.len);
    st.copy_segs.push_back(
        CopySegment{s.addr, src, take, s.kind, MemKind::kHost, s.region, src_region});
    src += take;
    n -= take;
  }
}

// Appends copies that gather `segs` into `dst`.
void add_gather(CommandState& st, std::byte* dst, const DataSegments& segs,
                uint64_t dst_region = 0) {
  for (const DataSegment& s : segs) {
    st.copy_segs.push_back(
        CopySegment{dst, s.addr, s.len, MemKind::kHost, s.kind, dst_region, s.region});
    dst += s.len;
  }
}

// The backend handed out bytes it holds (memory backend, cache) instead of filling the sink.
bool has_view(const BackendOp& op) { return op.view.bytes.data() != nullptr || op.view.keepalive; }

bool single_host_segment(const DataSegments& segs) {
  return segs.size() == 1 && segs[0].kind == MemKind::kHost;
}

// Reads a KeyList (List/Prefetch layout) from `buf`: 02h for a malformed list, 86h for a bad key
// size (nvme::read_key_list_status).
Status parse_key_list(std::span<const std::byte> buf, std::vector<Key>& out) {
  return nvme::read_key_list_status(
      buf.data(), buf.size(),
      [&](const unsigned char* k, uint16_t len) { out.push_back(Key::from_bytes(k, len)); });
}

std::span<std::byte> retrieve_sink(BackendOp* op, uint64_t value_len) {
  auto* cmd = static_cast<Command*>(op->user);
  CommandState& st = state_of(cmd);
  const size_t want = static_cast<size_t>(std::min<uint64_t>(value_len, st.deliver_cap));
  if (st.scatter.empty() && single_host_segment(st.segs)) {
    st.direct = true;
    return {st.segs[0].addr, want};
  }
  st.direct = false;
  if (!st.staging.resize(want)) {
    st.sink_failed = true;  // the backend gets nowhere to write; the command fails
    return {};
  }
  return {st.staging.data(), want};
}

void backend_done(BackendOp* op, Status status, uint64_t value_len) {
  auto* cmd = static_cast<Command*>(op->user);
  CommandState& st = state_of(cmd);
  st.status = status;
  st.value_len = value_len;
  st.owner->post(cmd);
}

void copy_done(CopyJob* job, Status status);

void launch_copy(Command* cmd, CmdPhase phase) {
  CommandState& st = state_of(cmd);
  st.phase = phase;
  st.copy.segs = st.copy_segs.data();
  st.copy.count = static_cast<uint32_t>(st.copy_segs.size());
  st.copy.done = &copy_done;
  st.copy.user = cmd;
  st.copy_start_ns = now_ns();
  st.owner->engine().submit(&st.copy);
}

void submit_backend(Command* cmd) {
  CommandState& st = state_of(cmd);
  st.phase = CmdPhase::kBackend;
  st.op.nsid = cmd->sqe.nsid;
  st.op.stream = cmd->stream;
  st.op.user = cmd;
  st.op.done = &backend_done;
  st.ctl->backend->submit(&st.op);
}

}  // namespace

bool Controller::Impl::find_region(uintptr_t addr, size_t len, MemoryRegion* out) const {
  if (region_count.load(std::memory_order_acquire) == 0) return false;
  std::shared_lock lk(regions_mu);
  auto it = regions.upper_bound(addr);
  if (it == regions.begin()) return false;
  --it;
  const MemoryRegion& r = it->second;
  if (addr < r.begin || addr + len > r.end || addr + len < addr) return false;
  *out = r;
  return true;
}

void Controller::Impl::finish(Command* cmd, Status status, uint32_t dw0) {
  CommandState& st = state_of(cmd);
  ReactorStats& rs = st.owner->stats();
  if (st.op_index != kNoOp) {
    bump(rs.ops[st.op_index]);
    if (status != Status::kSuccess) bump(rs.errors[st.op_index]);
  } else {
    bump(rs.invalid);
  }
  rs.latency.record(now_ns() - st.start_ns);
  st.op.view = ValueView{};
  st.op.value = {};
  st.op.keys.clear();
  st.staging.done(kKeepStagingBytes);
  st.phase = CmdPhase::kIdle;
  st.owner->in_flight().fetch_sub(1, std::memory_order_relaxed);
  cmd->complete(cmd, status, dw0);
}

namespace {

void finish(Command* cmd, Status s, uint32_t dw0 = 0) { state_of(cmd).ctl->finish(cmd, s, dw0); }

// After the key list of a Prefetch or the descriptors of a Scatter Retrieve were staged.
void after_staging(Command* cmd) {
  CommandState& st = state_of(cmd);
  std::span<const std::byte> buf(st.staging.data(), st.staging.size());
  if (st.phase == CmdPhase::kStoreStaging) {
    st.op.value = buf;
    submit_backend(cmd);
    return;
  }
  if (st.phase == CmdPhase::kPrefetchStaging) {
    st.op.keys.clear();
    const bool hint = (cmd->sqe.options & nvme::kPrefetchHint) != 0;
    // A stock Prefetch keeps 02h for any damage; a hint names a bad key size (86h).
    if (Status s = parse_key_list(buf, st.op.keys); s != Status::kSuccess) {
      return finish(cmd, hint ? s : Status::kInvalidField);
    }
    if (hint) {
      if (st.op.keys.empty()) return finish(cmd, Status::kInvalidField);
      st.ctl->backend->hint(cmd->sqe.nsid, st.op.keys);
    } else {
      st.ctl->backend->prefetch(cmd->sqe.nsid, st.op.keys);  // a hint: done once it is given
    }
    return finish(cmd, Status::kSuccess);
  }
  // Scatter: a header and `count` entries; each entry's destination must be mapped.
  nvme::ScatterHeader hdr;
  std::memcpy(&hdr, buf.data(), sizeof(hdr));
  if (hdr.count == 0 || hdr.count > nvme::kMaxScatterEntries ||
      sizeof(hdr) + size_t{hdr.count} * sizeof(nvme::ScatterEntry) > buf.size()) {
    return finish(cmd, Status::kInvalidField);
  }
  st.scatter.resize(hdr.count);
  std::memcpy(st.scatter.data(), buf.data() + sizeof(hdr), hdr.count * sizeof(nvme::ScatterEntry));
  st.scatter_segs.resize(hdr.count);
  uint64_t end = 0;
  for (uint32_t i = 0; i < hdr.count; ++i) {
    const nvme::ScatterEntry& e = st.scatter[i];
    st.scatter_segs[i].clear();
    if (e.length == 0) continue;
    Status s = cmd->space->map_range(e.address, e.length, true, st.scatter_segs[i]);
    if (s != Status::kSuccess) return finish(cmd, s);
    end = std::max<uint64_t>(end, uint64_t{e.value_offset} + e.length);
  }
  if (end > st.ctl->options.max_value_bytes) return finish(cmd, Status::kInvalidValueSize);
  st.deliver_cap = end;
  st.op.kind = BackendOpKind::kGet;
  st.op.sink = &retrieve_sink;
  submit_backend(cmd);
}

void copy_done(CopyJob* job, Status status) {
  auto* cmd = static_cast<Command*>(job->user);
  CommandState& st = state_of(cmd);
  ReactorStats& rs = st.owner->stats();
  bump(rs.copy_bytes, job->bytes());
  bump(rs.copy_ns, now_ns() - st.copy_start_ns);
  st.copy_segs.clear();
  if (status != Status::kSuccess) return finish(cmd, Status::kDataTransferError);
  if (st.phase == CmdPhase::kDeliver) {
    return finish(cmd, Status::kSuccess, static_cast<uint32_t>(st.value_len));
  }
  after_staging(cmd);
}

// Stages `len` bytes of the requester's data buffer into controller memory, then continues.
void stage_in(Command* cmd, size_t len, CmdPhase phase) {
  CommandState& st = state_of(cmd);
  if (!st.staging.resize(len)) return finish(cmd, Status::kInternalError);
  st.copy_segs.clear();
  add_gather(st, st.staging.data(), st.segs, st.staging.region());
  launch_copy(cmd, phase);
}

}  // namespace

void Controller::Impl::execute(Command* cmd) {
  if (!cmd->state) cmd->state = std::make_unique<CommandState>();
  CommandState& st = *cmd->state;
  st.ctl = this;
  st.owner = Reactor::current();
  st.staging.set_pool(st.owner->staging_pool());
  st.phase = CmdPhase::kIdle;
  st.start_ns = now_ns();
  st.op = BackendOp{};
  st.segs.clear();
  st.copy_segs.clear();
  st.staging.clear();
  st.scatter.clear();
  st.direct = false;
  st.sink_failed = false;
  st.deliver_cap = 0;
  st.status = Status::kSuccess;
  st.value_len = 0;
  st.owner->in_flight().fetch_add(1, std::memory_order_relaxed);

  const nvme::Sqe& sqe = cmd->sqe;
  st.op_index = op_index(sqe.opcode);
  if (st.op_index == kNoOp) return finish(cmd, Status::kInvalidOpcode);
  if (sqe.nsid == 0 || sqe.nsid > options.namespaces) return finish(cmd, Status::kInvalidNamespace);
  if ((sqe.flags & 0x3) != 0) return finish(cmd, Status::kInvalidField);  // no fused commands

  const auto opcode = static_cast<nvme::Opcode>(sqe.opcode);
  if (opcode == nvme::Opcode::kPrefetch) {
    const uint32_t len = sqe.cdw10;
    if (len < sizeof(nvme::KeyListHeader) || len > kMaxPrefetchBytes ||
        (sqe.options & ~nvme::kPrefetchOptionsValid) != 0) {
      return finish(cmd, Status::kInvalidField);
    }
    if (Status s = cmd->space->map_data(sqe, len, false, st.segs); s != Status::kSuccess) {
      return finish(cmd, s);
    }
    return stage_in(cmd, len, CmdPhase::kPrefetchStaging);
  }

  // Every other command names a key.
  st.op.key = Key::from_sqe(sqe);
  if (!st.op.key.valid()) return finish(cmd, Status::kInvalidKeySize);

  switch (opcode) {
    case nvme::Opcode::kStore: {
      if ((sqe.options & ~nvme::kStoreOptionsValid) != 0 ||
          (sqe.options & nvme::kStoreMustExist && sqe.options & nvme::kStoreMustNotExist)) {
        return finish(cmd, Status::kInvalidField);
      }
      const uint32_t len = sqe.cdw10;
      if (len > options.max_value_bytes) return finish(cmd, Status::kInvalidValueSize);
      if (Status s = cmd->space->map_data(sqe, len, false, st.segs); s != Status::kSuccess) {
        return finish(cmd, s);
      }
      st.op.kind = BackendOpKind::kPut;
      st.op.store_options = sqe.options & (nvme::kStoreMustExist | nvme::kStoreMustNotExist |
                                           nvme::kStoreLowPriority);
      if (len == 0 || single_host_segment(st.segs)) {
        if (len != 0) st.op.value = {st.segs[0].addr, len};
        return submit_backend(cmd);
      }
      return stage_in(cmd, len, CmdPhase::kStoreStaging);
    }
    case nvme::Opcode::kRetrieve: {
      if ((sqe.options & ~nvme::kRetrieveOptionsValid) != 0) {
        return finish(cmd, Status::kInvalidField);
      }
      const uint32_t cap = sqe.cdw10;
      if (Status s = cmd->space->map_data(sqe, cap, true, st.segs); s != Status::kSuccess) {
        return finish(cmd, s);
      }
      st.deliver_cap = cap;
      st.op.kind = BackendOpKind::kGet;
      st.op.sink = &retrieve_sink;
      return submit_backend(cmd);
    }
    case nvme::Opcode::kScatterRetrieve: {
      const uint32_t len = sqe.cdw10;
      if (len < sizeof(nvme::ScatterHeader) + sizeof(nvme::ScatterEntry) ||
          len >
              sizeof(nvme::ScatterHeader) + nvme::kMaxScatterEntries * sizeof(nvme::ScatterEntry)) {
        return finish(cmd, Status::kInvalidField);
      }
      if (Status s = cmd->space->map_data(sqe, len, false, st.segs); s != Status::kSuccess) {
        return finish(cmd, s);
      }
      return stage_in(cmd, len, CmdPhase::kScatterStaging);
    }
    case nvme::Opcode::kList: {
      const uint32_t cap = sqe.cdw10;
      if (cap < sizeof(nvme::KeyListHeader)) return finish(cmd, Status::kInvalidField);
      if (Status s = cmd->space->map_data(sqe, cap, true, st.segs); s != Status::kSuccess) {
        return finish(cmd, s);
      }
      st.deliver_cap = cap;
      st.op.kind = BackendOpKind::kList;
      st.op.list_max = std::min<uint32_t>((cap - 4) / 4, kMaxListKeys);
      return submit_backend(cmd);
    }
    case nvme::Opcode::kDelete:
      st.op.kind = BackendOpKind::kDelete;
      return submit_backend(cmd);
    case nvme::Opcode::kExist:
      st.op.kind = BackendOpKind::kExists;
      return submit_backend(cmd);
    default:
      return finish(cmd, Status::kInvalidOpcode);
  }
}

void Controller::Impl::on_backend_done(Command* cmd) {
  CommandState& st = state_of(cmd);
  const auto opcode = static_cast<nvme::Opcode>(cmd->sqe.opcode);
  if (opcode == nvme::Opcode::kRetrieve || opcode == nvme::Opcode::kScatterRetrieve) {
    NamespaceStats& ns = ns_stats[st.op.nsid - 1];
    if (st.status == Status::kSuccess) ns.hits.fetch_add(1, std::memory_order_relaxed);
    if (st.status == Status::kKeyNotExist) ns.misses.fetch_add(1, std::memory_order_relaxed);
  } else if (opcode == nvme::Opcode::kStore && st.status == Status::kSuccess) {
    ns_stats[st.op.nsid - 1].bytes_written.fetch_add(cmd->sqe.cdw10, std::memory_order_relaxed);
  }
  if (st.status != Status::kSuccess) return ::gdkv::finish(cmd, st.status);
  if (st.sink_failed) return ::gdkv::finish(cmd, Status::kInternalError);
  ReactorStats& rs = st.owner->stats();
  switch (opcode) {
    case nvme::Opcode::kRetrieve: {
      const uint64_t want = std::min(st.value_len, st.deliver_cap);
      bump(rs.bytes_out, want);
      if (has_view(st.op)) {
        st.copy_segs.clear();
        add_spread(st, st.op.view.bytes.data(), std::min<size_t>(want, st.op.view.bytes.size()),
                   st.segs);
        return launch_copy(cmd, CmdPhase::kDeliver);
      }
      if (st.direct || want == 0) {
        return ::gdkv::finish(cmd, Status::kSuccess, static_cast<uint32_t>(st.value_len));
      }
      st.copy_segs.clear();
      add_spread(st, st.staging.data(), std::min<size_t>(want, st.staging.size()), st.segs,
                 st.staging.region());
      return launch_copy(cmd, CmdPhase::kDeliver);
    }
    case nvme::Opcode::kScatterRetrieve: {
      const bool from_view = has_view(st.op);
      const std::byte* src = from_view ? st.op.view.bytes.data() : st.staging.data();
      const uint64_t have = from_view ? st.op.view.bytes.size() : st.staging.size();
      st.copy_segs.clear();
      for (size_t i = 0; i < st.scatter.size(); ++i) {
        const nvme::ScatterEntry& e = st.scatter[i];
        if (e.value_offset >= have) continue;
        const size_t n = static_cast<size_t>(std::min<uint64_t>(e.length, have - e.value_offset));
        bump(rs.bytes_out, n);
        add_spread(st, src + e.value_offset, n, st.scatter_segs[i],
                   from_view ? 0 : st.staging.region());
      }
      return launch_copy(cmd, CmdPhase::kDeliver);
    }
    case nvme::Opcode::kList: {
      // Encode as many keys as fit; dw0 = the number returned.
      if (!st.staging.resize(st.deliver_cap)) return ::gdkv::finish(cmd, Status::kInternalError);
      std::memset(st.staging.data(), 0, st.deliver_cap);
      nvme::KeyListWriter w(st.staging.data(), st.deliver_cap);
      for (const Key& k : st.op.keys) {
        if (!w.add(k.bytes, k.len)) break;
      }
      w.finish();
      st.value_len = w.count();
      st.copy_segs.clear();
      add_spread(st, st.staging.data(), w.bytes(), st.segs, st.staging.region());
      return launch_copy(cmd, CmdPhase::kDeliver);
    }
    case nvme::Opcode::kStore:
      bump(rs.bytes_in, cmd->sqe.cdw10);  // counted once the backend has the value
      return ::gdkv::finish(cmd, Status::kSuccess);
    default:
      return ::gdkv::finish(cmd, Status::kSuccess);
  }
}

// ---- Controller ---------------------------------------------------------------------------------

Controller::Controller(std::shared_ptr<Backend> backend, ControllerOptions options)
    : backend_(std::move(backend)), options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  if (!backend_) throw std::invalid_argument("controller needs a backend");
  if (options_.reactors == 0) options_.reactors = 1;
  if (options_.namespaces == 0) options_.namespaces = 1;
  // One largest value for the controller, Identify (which reads options()) and the backend.
  if (const uint64_t m = backend_->info().max_value_bytes; m != 0 && m < options_.max_value_bytes) {
    options_.max_value_bytes = m;
  }
  if (!options_.copy_engine) {
    options_.copy_engine = [](uint32_t) { return make_host_copy_engine(); };
  }
  impl_->self = this;
  impl_->backend = backend_.get();
  impl_->ns_stats = std::make_unique<Impl::NamespaceStats[]>(options_.namespaces);
  impl_->options = options_;
  for (uint32_t i = 0; i < options_.reactors; ++i) {
    impl_->reactors.push_back(std::make_unique<Reactor>(impl_.get(), i, options_.copy_engine(i)));
  }
  // Before the reactors start: an engine belongs to its reactor's thread once that runs.
  if (options_.measure_dma_peak) {
    impl_->dma_peak_bps = options_.measure_dma_peak(impl_->reactors[0]->engine());
  }
  for (auto& r : impl_->reactors) r->start();
}

Controller::~Controller() {
  stop();
  impl_->reactors.clear();
  impl_->queues.clear();
}

void Controller::stop() {
  if (impl_->stopping.exchange(true)) {
    // Already stopping or stopped; a second caller still waits for the reactors.
    for (auto& r : impl_->reactors) r->join();
    return;
  }
  while (in_flight() != 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  backend_->drain();
  for (auto& r : impl_->reactors) r->request_exit();
  for (auto& r : impl_->reactors) r->join();
}

Result<QueueRef> Controller::create_queue(const QueueOptions& options) {
  if (!valid_queue_depth(options.depth)) {
    return Error{"queue depth must be a power of two in [2, 4096], not " +
                 std::to_string(options.depth)};
  }
  const uint32_t n = impl_->next_queue.fetch_add(1);
  Reactor& r = *impl_->reactors[n % impl_->reactors.size()];
  Result<std::unique_ptr<QueuePoller>> made = catch_error([&] {
    return std::make_unique<QueuePoller>(impl_.get(), options, static_cast<uint16_t>(n + 1),
                                         r.wake_word());
  });
  if (!made) return Error{made.error()};
  std::unique_ptr<QueuePoller> poller = std::move(*made);
  QueueRef ref = poller->ref();
  r.add_poller(poller.get());
  std::lock_guard lk(impl_->queues_mu);
  impl_->queues.push_back(std::move(poller));
  return ref;
}

void Controller::destroy_queue(const QueueRef& q) {
  std::unique_ptr<Poller> victim;
  {
    std::lock_guard lk(impl_->queues_mu);
    for (auto it = impl_->queues.begin(); it != impl_->queues.end(); ++it) {
      if (static_cast<QueuePoller*>(it->get())->ref().sq == q.sq) {
        victim = std::move(*it);
        impl_->queues.erase(it);
        break;
      }
    }
  }
  if (victim) remove_poller(victim.get());
}

bool Controller::register_memory(const void* addr, size_t len, MemKind kind) {
  const auto begin = reinterpret_cast<uintptr_t>(addr);
  if (len == 0 || begin + len < begin) return false;
  std::unique_lock lk(impl_->regions_mu);
  auto it = impl_->regions.lower_bound(begin);
  if (it != impl_->regions.end() && it->second.begin < begin + len) return false;
  if (it != impl_->regions.begin() && std::prev(it)->second.end > begin) return false;
  impl_->regions.emplace(
      begin, MemoryRegion{begin, begin + len, kind, impl_->next_region_id.fetch_add(1)});
  impl_->region_count.fetch_add(1, std::memory_order_release);
  return true;
}

bool Controller::unregister_memory(const void* addr) {
  std::unique_lock lk(impl_->regions_mu);
  if (impl_->regions.erase(reinterpret_cast<uintptr_t>(addr)) == 0) return false;
  impl_->region_count.fetch_sub(1, std::memory_order_release);
  return true;
}

void Controller::add_poller(uint32_t reactor, Poller* p) {
  impl_->reactors[reactor % impl_->reactors.size()]->add_poller(p);
}

void Controller::remove_poller(Poller* p) {
  for (auto& r : impl_->reactors) r->remove_poller(p);
}

void Controller::execute(Command* cmd) { impl_->execute(cmd); }

uint32_t Controller::reactor_count() const { return static_cast<uint32_t>(impl_->reactors.size()); }

uint64_t Controller::in_flight() const {
  uint64_t n = 0;
  for (const auto& r : impl_->reactors) n += r->in_flight().load();
  return n;
}

Histogram Controller::latency() const {
  Histogram h;
  for (const auto& r : impl_->reactors) h.merge(r->stats().latency.snapshot());
  return h;
}

void Controller::collect(MetricList& out) const {
  for (const auto& r : impl_->reactors) {
    const ReactorStats& s = r->stats();
    const std::string idx = std::to_string(r->index());
    MetricWriter w(out, {{"reactor", idx}});
    auto add = [&](const char* name, const char* help, MetricType type, double v,
                   MetricLabels labels = {}) { w.add(name, help, type, v, std::move(labels)); };
    for (int i = 0; i < ReactorStats::kOps; ++i) {
      add("commands_total", "NVMe-KV commands completed", MetricType::kCounter,
          static_cast<double>(s.ops[i].load()), {{"op", kOpNames[i]}});
      add("command_errors_total", "commands completed with a non-success status",
          MetricType::kCounter, static_cast<double>(s.errors[i].load()), {{"op", kOpNames[i]}});
    }
    add("commands_invalid_total", "commands rejected for an unknown opcode", MetricType::kCounter,
        static_cast<double>(s.invalid.load()));
    add("value_bytes_in_total", "value bytes stored", MetricType::kCounter,
        static_cast<double>(s.bytes_in.load()));
    add("value_bytes_out_total", "value bytes delivered", MetricType::kCounter,
        static_cast<double>(s.bytes_out.load()));
    add("dma_bytes_total", "bytes moved by the copy engine", MetricType::kCounter,
        static_cast<double>(s.copy_bytes.load()), {{"engine", r->engine().name()}});
    add("dma_busy_seconds_total", "time copies were in flight", MetricType::kCounter,
        static_cast<double>(s.copy_ns.load()) / 1e9, {{"engine", r->engine().name()}});
    if (impl_->dma_peak_bps > 0) {
      const std::pair<std::string, std::string> eng{"engine", r->engine().name()};
      add("dma_link_peak_bytes_per_second", "copy engine peak bandwidth, measured at start",
          MetricType::kGauge, impl_->dma_peak_bps, {eng});
      // Utilisation over the interval since the previous collect of this reactor.
      const uint64_t bytes = s.copy_bytes.load(), now = now_ns();
      double util = 0;
      {
        std::lock_guard lk(impl_->util_mu);
        if (impl_->util_last.size() < impl_->reactors.size()) {
          impl_->util_last.resize(impl_->reactors.size(), {0, 0});
        }
        auto& [last_bytes, last_ns] = impl_->util_last[r->index()];
        if (last_ns != 0 && now > last_ns) {
          util = static_cast<double>(bytes - last_bytes) * 1e9 /
                 static_cast<double>(now - last_ns) / impl_->dma_peak_bps;
        }
        last_bytes = bytes;
        last_ns = now;
      }
      add("dma_link_utilization", "DMA bandwidth since the previous collect / measured peak",
          MetricType::kGauge, util, {eng});
    }
    add("queue_depth", "commands in flight", MetricType::kGauge,
        static_cast<double>(r->in_flight().load()));
    add("reactor_busy_polls_total", "poll iterations that found work", MetricType::kCounter,
        static_cast<double>(s.busy_polls.load()));
    add("reactor_sleeps_total", "times the reactor went to sleep", MetricType::kCounter,
        static_cast<double>(s.sleeps.load()));
    const Histogram h = s.latency.snapshot();
    for (double q : {0.5, 0.99, 0.999}) {
      add("command_latency_seconds", "command latency, fetch to completion", MetricType::kGauge,
          static_cast<double>(h.percentile(q)) / 1e9, {{"quantile", std::to_string(q)}});
    }
    add("command_latency_jitter_seconds", "p99 minus p50 command latency", MetricType::kGauge,
        static_cast<double>(h.percentile(0.99) - h.percentile(0.5)) / 1e9);
  }
  MetricWriter w(out);
  for (uint32_t i = 0; i < options_.namespaces; ++i) {
    const Impl::NamespaceStats& ns = impl_->ns_stats[i];
    if (ns.hits.load(std::memory_order_relaxed) == 0 &&
        ns.misses.load(std::memory_order_relaxed) == 0 &&
        ns.bytes_written.load(std::memory_order_relaxed) == 0) {
      continue;  // a namespace nobody has used yet
    }
    const MetricLabels l{{"namespace", std::to_string(i + 1)}};
    w.counter("namespace_hits_total", "Retrieves of the backend namespace that found their key",
              ns.hits, l);
    w.counter("namespace_misses_total", "Retrieves of the backend namespace that found no key",
              ns.misses, l);
    w.counter("namespace_written_bytes_total", "value bytes stored in the backend namespace",
              ns.bytes_written, l);
  }
  backend_->collect(out);
}

}  // namespace gdkv
