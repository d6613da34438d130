#define HASH_IMPL generic
#include "backend/local/hash_impl.inc"
