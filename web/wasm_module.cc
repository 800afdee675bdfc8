// The WebAssembly module's exports are c_api.h's functions, linked from the library (web/CMakeLists.txt
// names them); the module has no main and nothing of its own.
#include "trainmem/c_api.h"
