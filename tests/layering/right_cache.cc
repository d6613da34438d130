// Compiles: the cache layer includes its own headers and the backend interface below it.
#include "cache/policy.h"
#include "gdkv/backend.h"
#include "gdkv/cache.h"
#include "gdkv/key.h"
