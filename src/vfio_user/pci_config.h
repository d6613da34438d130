// The PCI Express configuration space of the emulated NVMe controller (4 KiB).
//
// Type 0 header with class code 01/08/02 (mass storage / NVM / NVM Express), BAR0 a 64-bit
// memory BAR of kBar0Size, BAR4 a 32-bit memory BAR holding the MSI-X table and PBA, and a
// capability list: power management (0x40), MSI-X (0x50), PCI Express endpoint (0x60). Writes go
// through per-byte write masks, so read-only fields stay put and BAR sizing (write all ones, read
// back the size mask) works as on hardware.
//
// Thread safety: not thread-safe; the connection's socket thread owns it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace gdkv::vfio_user {

struct PciIds {
  uint16_t vendor = 0x4e58;  // configurable: see docs/vfio-user.md
  uint16_t device = 0x0001;
  uint16_t subsystem_vendor = 0x4e58;
  uint16_t subsystem = 0x0001;
};

inline constexpr uint32_t kConfigSize = 4096;
inline constexpr uint32_t kBar4Size = 0x2000;  // MSI-X table at 0, PBA at 0x1000
inline constexpr uint32_t kMsixTableOffset = 0x0;
inline constexpr uint32_t kMsixPbaOffset = 0x1000;
inline constexpr uint8_t kCapPm = 0x40;
inline constexpr uint8_t kCapMsix = 0x50;
inline constexpr uint8_t kCapPcie = 0x60;

class PciConfig {
 public:
  PciConfig(const PciIds& ids, uint16_t msix_vectors);

  // Byte-granular access inside [0, 4096). False when the range is out of bounds.
  bool read(uint32_t offset, std::span<std::byte> out) const;
  bool write(uint32_t offset, std::span<const std::byte> in);

  bool msix_enabled() const;
  bool bus_master() const;
  uint16_t msix_vectors() const { return msix_vectors_; }

 private:
  void set8(uint32_t off, uint8_t v) { bytes_[off] = v; }
  void set16(uint32_t off, uint16_t v);
  void set32(uint32_t off, uint32_t v);
  void mask16(uint32_t off, uint16_t m);
  void mask32(uint32_t off, uint32_t m);

  std::array<uint8_t, kConfigSize> bytes_{};
  std::array<uint8_t, kConfigSize> wmask_{};  // bits the host may change
  uint16_t msix_vectors_;
};

}  // namespace gdkv::vfio_user
