// Running other programs from the benchmarks (fio, python3, strata itself) through the shell.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>

namespace strata::bench {

// `s` as one single-quoted shell word, whatever it contains.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// This program (the strata binary the benchmark runs in), quoted for the shell: the benchmarks
// run `strata train` and `strata launch` as children of themselves.
inline std::string self_command() { return shell_quote(std::filesystem::read_symlink("/proc/self/exe").string()); }

// Runs `command` through the shell; its stderr passes through, its stdout is returned. A
// failure (exit status or signal) throws, naming `who` and the command.
inline std::string run_capture(const std::string& command, const std::string& who) {
  std::cerr << who << ": " << command << std::endl;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error(who + ": cannot run " + command);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0)
    throw std::runtime_error(who + ": failed (" +
                             (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                                  : "exit " + std::to_string(WEXITSTATUS(status))) +
                             "): " + command);
  return out;
}

}  // namespace strata::bench
