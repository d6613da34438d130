// Must not compile: the controller knows the transport interfaces, not a transport.
#include "gdkv/vfio_user.h"
