// Client's batch calls: one result per key, each batch one execute_batch (client.h).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "gdkv/client.h"
#include "gdkv/commands.h"

namespace gdkv {
namespace {

CmdResult invalid_field() { return CmdResult{nvme::Status::kInvalidField, nvme::kSctGeneric, 0}; }

std::vector<CmdResult> results_of(const std::vector<BatchItem>& items) {
  std::vector<CmdResult> out;
  out.reserve(items.size());
  for (const BatchItem& it : items) out.push_back(it.result);
  return out;
}

// Items of `make(key)`'s command with no data buffer (Exist, Delete).
template <class Make>
std::vector<BatchItem> bare_items(std::span<const Key> keys, Make make) {
  std::vector<BatchItem> items(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) items[i].sqe = make(keys[i]);
  return items;
}

}  // namespace

std::vector<CmdResult> Client::exists_many(std::span<const Key> keys, uint32_t nsid) {
  auto items = bare_items(keys, [&](const Key& k) { return cmd::exist(k.bytes, k.len, nsid); });
  execute_batch(items);
  return results_of(items);
}

std::vector<CmdResult> Client::del_many(std::span<const Key> keys, uint32_t nsid) {
  auto items = bare_items(keys, [&](const Key& k) { return cmd::remove(k.bytes, k.len, nsid); });
  execute_batch(items);
  return results_of(items);
}

std::vector<CmdResult> Client::put_many(std::span<const Key> keys,
                                        std::span<const std::span<const std::byte>> values,
                                        uint8_t options, uint32_t nsid) {
  if (values.size() != keys.size()) return std::vector<CmdResult>(keys.size(), invalid_field());
  std::vector<size_t> sent;  // the items that go out (a value past 4 GiB does not)
  std::vector<CmdResult> out(keys.size());
  std::vector<BatchItem> batch;
  batch.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& v = values[i];
    if (v.size() > std::numeric_limits<uint32_t>::max()) {
      out[i] = CmdResult{nvme::Status::kInvalidValueSize, nvme::kSctGeneric, 0};  // as put()
      continue;
    }
    BatchItem it;
    it.sqe = cmd::store(keys[i].bytes, keys[i].len, v.data(), static_cast<uint32_t>(v.size()),
                        options, nsid);
    it.data = v.data();
    it.len = v.size();
    it.to_controller = true;
    batch.push_back(it);
    sent.push_back(i);
  }
  execute_batch(batch);
  for (size_t j = 0; j < sent.size(); ++j) out[sent[j]] = batch[j].result;
  return out;
}

std::vector<CmdResult> Client::get_many_into(
    std::span<const Key> keys, std::span<const std::span<const nvme::ScatterEntry>> outs,
    uint32_t nsid) {
  if (outs.size() != keys.size()) return std::vector<CmdResult>(keys.size(), invalid_field());
  std::vector<std::vector<std::byte>> descs(keys.size());
  std::vector<BatchItem> items(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const Key& k = keys[i];
    const auto& pieces = outs[i];
    BatchItem& it = items[i];
    if (pieces.size() == 1 && pieces[0].value_offset == 0) {
      auto* p = reinterpret_cast<void*>(pieces[0].address);
      it.sqe = cmd::retrieve(k.bytes, k.len, p, pieces[0].length, nsid);
      it.data = p;
      it.len = pieces[0].length;
      continue;
    }
    descs[i] = scatter_descriptor(pieces);
    it.sqe = cmd::scatter_retrieve(k.bytes, k.len, descs[i].data(),
                                   static_cast<uint32_t>(descs[i].size()), nsid);
    it.data = descs[i].data();
    it.len = descs[i].size();
    it.to_controller = true;
    it.metadata = true;
  }
  execute_batch(items);
  return results_of(items);
}

size_t Client::lookup_prefix(std::span<const Key> keys, uint32_t nsid, CmdResult* stop) {
  if (stop != nullptr) *stop = CmdResult{nvme::Status::kSuccess, nvme::kSctGeneric, 0};
  size_t n = 0;
  for (size_t round = 16; n < keys.size(); round *= 2) {
    const size_t end = std::min(keys.size(), n + round);
    const std::vector<CmdResult> r = exists_many(keys.subspan(n, end - n), nsid);
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i].ok()) continue;
      if (stop != nullptr) *stop = r[i];
      return n + i;
    }
    n = end;
  }
  return n;
}

}  // namespace gdkv
