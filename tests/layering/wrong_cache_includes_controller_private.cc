// Must not compile: another layer's private header.
#include "controller/reactor.h"
