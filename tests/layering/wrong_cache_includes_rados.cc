// Must not compile: the cache knows the backend interface, not a backend.
#include "gdkv/rados_backend.h"
