// A judge of --tensor-type patterns: C++'s std::regex (ECMAScript, the compiler's own library), as
// llama-quantize compiles a pattern and searches it in a tensor's name (std::regex_search). k3lab's.
// Input, one item a line: "P<TAB>pattern" or "N<TAB>name" (bytes; no newline inside).
// Output, a line per pattern: "E" when std::regex refuses it, "T" when its searches take over two
// seconds (each pattern runs in a child process of its own, killed then), else one 0/1 per name.
#include <csignal>
#include <iostream>
#include <regex>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

static std::string verdict(const std::string & p, const std::vector<std::string> & names) {
    try {
        const std::regex re(p);
        std::string found;
        for (const auto & n : names) found += std::regex_search(n, re) ? '1' : '0';
        return found;
    } catch (const std::regex_error &) {
        return "E";
    }
}

int main() {
    std::string line;
    std::vector<std::string> patterns, names;
    while (std::getline(std::cin, line)) {
        if (line.size() < 2 || line[1] != '\t') continue;
        (line[0] == 'P' ? patterns : names).push_back(line.substr(2));
    }
    for (const auto & p : patterns) {
        int fds[2];
        if (pipe(fds) != 0) return 1;
        const pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            alarm(2);
            const std::string out = verdict(p, names) + "\n";
            (void) !write(fds[1], out.data(), out.size());
            _exit(0);
        }
        close(fds[1]);
        std::string out;
        char buf[4096];
        for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, n);
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        std::cout << (WIFEXITED(status) && WEXITSTATUS(status) == 0 && !out.empty() ? out : std::string("T\n"));
    }
}
