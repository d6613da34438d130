// Must not compile: backends sit below the cache.
#include "gdkv/cache.h"
