// `trainmem serve`: a static HTTP/1.0 file server over POSIX sockets, one request at a time: GET and HEAD of
// the files directly in the page's folder (no sub-folders, no "..", so nothing else on the disk is reachable).
#include "serve.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string_view>

#include "trainmem/error.h"

namespace trainmem::cli {

namespace {

constexpr size_t kMaxRequestBytes = 8192;  // a request line and headers; a browser's are well below
constexpr int kListenBacklog = 16;
constexpr time_t kRecvTimeoutSeconds = 5;  // one request at a time: a client that sends nothing is dropped

// The page's files by their ending.
std::string_view content_type(std::string_view name) {
  if (name.ends_with(".html")) return "text/html; charset=utf-8";
  if (name.ends_with(".js")) return "text/javascript; charset=utf-8";
  if (name.ends_with(".css")) return "text/css; charset=utf-8";
  if (name.ends_with(".svg")) return "image/svg+xml";
  if (name.ends_with(".png")) return "image/png";
  if (name.ends_with(".json")) return "application/json";
  if (name.ends_with(".wasm")) return "application/wasm";
  return "application/octet-stream";
}

// A file name of the folder: letters, digits, '.', '-' and '_', not starting with '.'.
bool plain_name(std::string_view name) {
  if (name.empty() || name[0] == '.') return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '-' || c == '_';
    if (!ok) return false;
  }
  return true;
}

void send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;  // the browser went away: nothing to do
    data.remove_prefix(static_cast<size_t>(n));
  }
}

void respond(int fd, int status, std::string_view reason, std::string_view type, const std::string& body, bool head) {
  send_all(fd, fmt::format("HTTP/1.0 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n"
                           "Connection: close\r\n\r\n", status, reason, type, body.size()));
  if (!head) send_all(fd, body);
}

// One connection: read the request line, answer, close.
void handle(int fd, const std::filesystem::path& root) {
  std::string req;
  std::array<char, 2048> buf{};
  while (req.find("\r\n\r\n") == std::string::npos && req.size() < kMaxRequestBytes) {
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    req.append(buf.data(), static_cast<size_t>(n));
  }
  std::istringstream line(req.substr(0, req.find("\r\n")));
  std::string method, target;
  line >> method >> target;
  const bool head = method == "HEAD";
  if (method != "GET" && !head) return respond(fd, 405, "Method Not Allowed", "text/plain", "GET or HEAD only\n", false);
  std::string name = target.substr(0, target.find_first_of("?#"));
  if (name == "/") name = "/index.html";
  name.erase(0, 1);
  if (!plain_name(name)) return respond(fd, 404, "Not Found", "text/plain", "not found\n", head);
  std::ifstream in(root / name, std::ios::binary);
  if (!in) return respond(fd, 404, "Not Found", "text/plain", "not found\n", head);
  std::ostringstream body;
  body << in.rdbuf();
  respond(fd, 200, "OK", content_type(name), body.str(), head);
}

}  // namespace

std::string default_web_root(const char* argv0) {
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) exe = std::filesystem::absolute(argv0 ? argv0 : "trainmem", ec);
  return (exe.parent_path() / "web").string();
}

void serve(const ServeOptions& o) {
  const std::filesystem::path root(o.root);
  for (const char* f : {"index.html", "trainmem.js"}) {
    if (!std::filesystem::is_regular_file(root / f)) {
      throw Error(fmt::format("serve: no {} in \"{}\": build the page with make web (it needs emscripten: bash "
                              "scripts/setup.sh), or give its folder with --root", f, o.root));
    }
  }
  in_addr addr{};
  if (::inet_pton(AF_INET, o.host.c_str(), &addr) != 1) {
    throw Error(fmt::format("--host \"{}\": expected an IPv4 address like 127.0.0.1", o.host));
  }
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw Error(fmt::format("serve: socket: {}", std::strerror(errno)));
  const int yes = 1;
  ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = addr;
  sa.sin_port = htons(o.port);
  if (::bind(s, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(s, kListenBacklog) != 0) {
    const std::string why = std::strerror(errno);
    ::close(s);
    throw Error(fmt::format("--port {}: cannot listen on {}:{} ({})", o.port, o.host, o.port, why));
  }
  socklen_t len = sizeof sa;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&sa), &len);
  std::cout << fmt::format("trainmem: serving {} at http://{}:{}/ (Ctrl-C stops)", o.root, o.host, ntohs(sa.sin_port))
            << std::endl;
  for (;;) {
    const int c = ::accept(s, nullptr, nullptr);
    if (c < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("serve: accept: {}", std::strerror(errno)));
    }
    const timeval timeout{kRecvTimeoutSeconds, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    handle(c, root);
    ::close(c);
  }
}

}  // namespace trainmem::cli
