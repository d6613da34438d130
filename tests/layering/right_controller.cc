// Compiles: the controller layer includes its own private headers and the layers below it.
#include "common/clock.h"
#include "controller/reactor.h"
#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "gdkv/copy_engine.h"
#include "gdkv/queue.h"
