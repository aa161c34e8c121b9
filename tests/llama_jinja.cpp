// k3lab's test harness around llama.cpp's own Jinja engine (common/jinja): the template parsed once as
// common_chat_template parses it (lexer, parser, caps), then one render per input line.
// stdin: the template's length in bytes, a newline, the template, then one JSON object per line (the
// context: messages, tools, add_generation_prompt, ...). stdout: one JSON line per input,
// {"text": ...} or {"error": ...}. The first stdout line is the caps llama.cpp derives.
#include "jinja/caps.h"
#include "jinja/lexer.h"
#include "jinja/parser.h"
#include "jinja/runtime.h"
#if __has_include("json.h")
#include "json.h"  // upstream's wrapper of nlohmann's ordered_json
#else
#include <nlohmann/json.hpp>  // an older tree (unsloth's fork): nlohmann's own
using common_json = nlohmann::ordered_json;
#endif

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

extern "C" void ggml_abort(const char * file, int line, const char * fmt, ...) {
    std::fprintf(stderr, "abort at %s:%d (%s)\n", file, line, fmt);
    std::abort();
}

int main() {
    std::string first;
    if (!std::getline(std::cin, first)) return 2;
    size_t n = std::stoul(first);
    std::string src(n, '\0');
    std::cin.read(&src[0], (std::streamsize) n);
    std::string rest;
    std::getline(std::cin, rest);  // the template's own last newline, if any
    jinja::lexer lexer;
    jinja::program prog;
    try {
        auto lexed = lexer.tokenize(src);
        prog = jinja::parse_from_tokens(lexed);
        auto caps = jinja::caps_get(prog);
        common_json out = common_json::object();
        for (const auto & [key, value] : caps.to_map()) out[key] = value;
        std::cout << out.dump() << "\n" << std::flush;
    } catch (const std::exception & e) {
        common_json out = common_json::object();
        out["error"] = std::string(e.what());
        std::cout << out.dump() << "\n" << std::flush;
        return 1;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
        common_json out = common_json::object();
        try {
            common_json inp = common_json::parse(line);
            jinja::context ctx(src);
            jinja::global_from_json(ctx, inp, false);
            jinja::runtime runtime(ctx);
            const jinja::value results = runtime.execute(prog);
            auto parts = jinja::runtime::gather_string_parts(results);
            out["text"] = parts->as_string().str();
        } catch (const std::exception & e) {
            out["error"] = std::string(e.what());
        }
        std::cout << out.dump() << "\n" << std::flush;
    }
    return 0;
}
