// Device memory for gdkvd's vendor admin command C0h: opens a client's CUDA IPC handle in
// gdkvd's process, so the GPU copy engine can reach that client's GPU buffer (CUDA builds only).
#pragma once

#include <memory>

#include "gdkv/vfio_user.h"

namespace gdkvd {

std::unique_ptr<gdkv::DeviceMemoryImporter> make_cuda_importer();

}  // namespace gdkvd
