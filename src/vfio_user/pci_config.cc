#include "vfio_user/pci_config.h"

#include <cstring>

#include "vfio_user/nvme_defs.h"

namespace gdkv::vfio_user {

void PciConfig::set16(uint32_t off, uint16_t v) { std::memcpy(&bytes_[off], &v, 2); }
void PciConfig::set32(uint32_t off, uint32_t v) { std::memcpy(&bytes_[off], &v, 4); }
void PciConfig::mask16(uint32_t off, uint16_t m) { std::memcpy(&wmask_[off], &m, 2); }
void PciConfig::mask32(uint32_t off, uint32_t m) { std::memcpy(&wmask_[off], &m, 4); }

PciConfig::PciConfig(const PciIds& ids, uint16_t msix_vectors) : msix_vectors_(msix_vectors) {
  set16(0x00, ids.vendor);
  set16(0x02, ids.device);
  // Command: memory space, bus master, INTx disable are the host's to set.
  mask16(0x04, 0x0406);
  set16(0x06, 0x0010);  // status: capability list present
  set8(0x08, 0x00);     // revision
  set8(0x09, 0x02);     // programming interface: NVM Express
  set8(0x0A, 0x08);     // subclass: non-volatile memory controller
  set8(0x0B, 0x01);     // class: mass storage
  wmask_[0x0C] = 0xFF;  // cache line size
  wmask_[0x0D] = 0xFF;  // latency timer
  set8(0x0E, 0x00);     // header type 0, single function

  // BAR0/1: 64-bit non-prefetchable memory; the low bits of the size are read-only zeros.
  set32(0x10, 0x4);
  mask32(0x10, static_cast<uint32_t>(~(kBar0Size - 1)) & ~0xFu);
  mask32(0x14, 0xFFFFFFFFu);
  // BAR4: 32-bit memory with the MSI-X table and PBA. BAR2, 3, 5 are unimplemented (read 0).
  set32(0x20, 0x0);
  mask32(0x20, static_cast<uint32_t>(~(kBar4Size - 1)) & ~0xFu);

  set16(0x2C, ids.subsystem_vendor);
  set16(0x2E, ids.subsystem);
  set8(0x34, kCapPm);
  wmask_[0x3C] = 0xFF;  // interrupt line
  set8(0x3D, 0x00);     // interrupt pin: none (MSI-X only)

  // Power management: version 3, D0 only; PMCSR power state bits writable.
  set8(kCapPm + 0, 0x01);
  set8(kCapPm + 1, kCapMsix);
  set16(kCapPm + 2, 0x0003);
  mask16(kCapPm + 4, 0x0003);

  // MSI-X: table size N-1; enable (bit 15) and function mask (bit 14) are the host's.
  set8(kCapMsix + 0, 0x11);
  set8(kCapMsix + 1, kCapPcie);
  set16(kCapMsix + 2, static_cast<uint16_t>(msix_vectors - 1));
  mask16(kCapMsix + 2, 0xC000);
  set32(kCapMsix + 4, kMsixTableOffset | 4);  // BIR 4
  set32(kCapMsix + 8, kMsixPbaOffset | 4);

  // PCI Express capability v2, endpoint; link 2.5 GT/s x1; device control and link control
  // writable (they change nothing here).
  set8(kCapPcie + 0, 0x10);
  set8(kCapPcie + 1, 0x00);
  set16(kCapPcie + 2, 0x0002);
  set32(kCapPcie + 4, 0x00008000);  // device capabilities: role-based error reporting
  mask16(kCapPcie + 8, 0x7FFF);     // device control
  set32(kCapPcie + 0xC, 0x00000011);
  mask16(kCapPcie + 0x10, 0x0FFF);  // link control
  set16(kCapPcie + 0x12, 0x0011);   // link status: 2.5 GT/s x1
  mask16(kCapPcie + 0x28, 0xFFFF);  // device control 2
}

bool PciConfig::read(uint32_t offset, std::span<std::byte> out) const {
  if (offset > kConfigSize || out.size() > kConfigSize - offset) return false;
  std::memcpy(out.data(), &bytes_[offset], out.size());
  return true;
}

bool PciConfig::write(uint32_t offset, std::span<const std::byte> in) {
  if (offset > kConfigSize || in.size() > kConfigSize - offset) return false;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint32_t at = offset + static_cast<uint32_t>(i);
    const uint8_t m = wmask_[at];
    bytes_[at] = static_cast<uint8_t>((bytes_[at] & ~m) | (static_cast<uint8_t>(in[i]) & m));
  }
  return true;
}

bool PciConfig::msix_enabled() const { return bytes_[kCapMsix + 3] & 0x80; }
bool PciConfig::bus_master() const { return bytes_[0x04] & 0x04; }

}  // namespace gdkv::vfio_user
