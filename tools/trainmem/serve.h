// `trainmem serve`: the web page (web/, built by make web into <build>/web) over HTTP on this machine, for a
// browser that will not run WebAssembly from a file. A static file server and nothing else: the page computes
// in the browser, with the library compiled to WebAssembly.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace trainmem::cli {

struct ServeOptions {
  std::string root;                 // the folder served: index.html, app.js, style.css, trainmem.js
  std::string host = "127.0.0.1";   // only this machine, unless asked otherwise
  uint16_t port = 8000;             // 0: any free port (the line printed says which)
};

// Serves `o.root` until the process is stopped. Prints "trainmem: serving <root> at http://<host>:<port>/" on
// stdout once listening. Throws trainmem::Error when the folder holds no page or the port cannot be had.
void serve(const ServeOptions& o);

// The folder the page is served from by default: <folder of this executable>/web (the build's, make web).
std::string default_web_root(const char* argv0);

}  // namespace trainmem::cli
