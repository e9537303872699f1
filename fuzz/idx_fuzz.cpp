// libFuzzer target: the IDX reader on arbitrary bytes, raw (parse_idx) and, for gzip input, through
// zlib (read_idx on an in-memory file). Any input must give a tensor or a tg::Error, never a crash, a
// leak or an out-of-bounds access (built with ASan and UBSan).
#include <tapegrad/tapegrad.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::uint8_t> bytes(data, data + size);
  try {
    const auto t = tg::data::parse_idx(bytes, "fuzz");
    if (t.size() > 0) (void)t.data()[t.size() - 1];
  } catch (const tg::Error&) {
  }
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) {
    const int fd = ::memfd_create("idx_fuzz", 0);
    if (fd >= 0) {
      if (::write(fd, data, size) == static_cast<ssize_t>(size)) {
        try {
          (void)tg::data::read_idx("/proc/self/fd/" + std::to_string(fd));
        } catch (const tg::Error&) {
        }
      }
      ::close(fd);
    }
  }
  return 0;
}
