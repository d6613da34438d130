// Compiled with -mavx2 (see CMakeLists.txt); called only when the CPU reports AVX2.
#define HASH_IMPL avx2
#include "backend/local/hash_impl.inc"
