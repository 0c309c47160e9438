// Helpers the `kuai` subcommands share: reading an option, the path of this executable, running
// another command (a benchmark's arm, mpirun) and keeping what it printed, a median.
#pragma once

#include <string>
#include <vector>

namespace kuai::app {

// "--name=value" or "--name value"; advances i past what it consumed. Throws when the value is
// missing.
bool take_option(const std::vector<std::string>& args, size_t& i, const std::string& name,
                 std::string& value);

// The value of --name as a number above zero; throws std::invalid_argument naming the option.
double positive_number(const std::string& name, const std::string& value);

// This executable (/proc/self/exe), or build/kuai when that cannot be read.
std::string self_path();

// Runs `cmd` through the shell and returns what it wrote to stdout and stderr; its exit status
// (-1 when it did not exit normally or could not start) goes to *exit_status.
std::string run_captured(const std::string& cmd, int* exit_status);

// `kuai launch ...` (launch.cpp): a supervisor that restarts a failed mpirun job from its
// latest checkpoint.
int run_launch(const std::vector<std::string>& args);

// `kuai tokenize ...` (tokenize.cpp): each input line's token ids, or with --decode its text.
int run_tokenize(const std::vector<std::string>& args);

// The middle value, or the mean of the two middle ones (with 2 rounds, not the best); 0 for none.
double median(std::vector<double> v);

}  // namespace kuai::app
