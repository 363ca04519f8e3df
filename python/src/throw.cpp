// PyTorch's pluggable allocator does not check the pointer its malloc returns: a null pointer
// becomes a tensor at address 0. An allocation that fails must throw a C++ exception through
// PyTorch instead, which it turns into a Python RuntimeError carrying the message. Rust
// cannot throw one; this function does, for `emm_torch_malloc` (an `extern "C-unwind"`
// function, which lets the exception pass through its frame).
#include <stdexcept>

extern "C" [[noreturn]] void emm_throw_runtime_error(const char* message) {
    // The message is copied into the exception before the caller's frame unwinds.
    throw std::runtime_error(message);
}
