// The examples' command line and main: the options both have, the device picked at run time
// (tg::with_device: one body, a template on the device), the compute dtype as a template parameter, and
// the exit codes: 0 done; 1 an error, or a training that diverged; 2 bad input (options, data, --out),
// said before any training. Shared by the examples (namespace examples).
#pragma once

#include <CLI/CLI.hpp>
#include <tapegrad/tapegrad.hpp>

#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>

#include "dataset.hpp"

namespace examples {

/// The options both examples have.
struct CommonOptions {
  std::string dtype = "f32", device = "auto", data_dir, out;
  bool no_download = false, quiet = false;
};

/// The options every example has but --dtype: the device, the data, the outputs.
inline void add_device_data_output_options(CLI::App& app, CommonOptions& o) {
  app.add_option("--device", o.device, "auto: CUDA when a GPU is there (in the nvcc build), else the CPU")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "directory searched first for the four Fashion-MNIST .gz files");
  app.add_option("--out", o.out, "output directory")->capture_default_str();
  app.add_flag("--no-download", o.no_download, "never download the data set");
  app.add_flag("--quiet", o.quiet, "print nothing but errors");
}

/// The options the examples that train in f32 or bf16 have.
inline void add_common_options(CLI::App& app, CommonOptions& o, const std::string& dtype_help) {
  app.add_option("--dtype", o.dtype, dtype_help)->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  add_device_data_output_options(app, o);
}

/// The training loss went NaN or infinite: the run stops at the first logged step that shows it (exit 1).
struct Diverged : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// --device cuda where this program cannot use a GPU is bad input: a DataError naming the option and why.
inline void check_device_option(const std::string& device) {
  try {
    (void)tg::with_device(device, [&]<class D>() { return 0; });  // [&]: nvcc warns (445-D) on a captureless template lambda
  } catch (const tg::Error& e) {
    throw DataError("--device " + device + ": " + e.what() + "; use --device cpu or auto");
  }
}

/// f.template operator()<C>() with C the compute dtype --dtype names: float or tg::bf16.
template <class F>
decltype(auto) with_compute_dtype(const std::string& dtype, F&& f) {
  if (dtype == "bf16") return f.template operator()<tg::bf16>();
  return f.template operator()<float>();
}

/// Runs an example's main body and turns what it throws into the exit codes and a message on stderr; with
/// `stop_others` (data parallel), the other ranks are stopped with the same code first.
template <class Body>
int run_main(const char* program, Body&& body, const std::function<void(const std::string&, int)>& stop_others = {}) {
  auto fail = [&](const std::string& message, int code) {
    if (stop_others) stop_others(std::string(program) + ": " + message, code);
    std::cerr << program << ": " << message << "\n";
    return code;
  };
  try {
    return body();
  } catch (const Diverged& e) {
    return fail(e.what(), 1);
  } catch (const DataError& e) {
    return fail(e.what(), 2);
  } catch (const std::exception& e) {
    return fail(std::string("error: ") + e.what(), 1);
  }
}

}  // namespace examples
