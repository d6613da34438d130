// Must not compile: the wire format knows nothing of queues.
#include "gdkv/queue.h"
