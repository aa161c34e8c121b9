"""k3lab's own calibration text for Kimi-K3's importance matrix (``k3lab imatrix`` without
``--calibration``): what users feed the model, in the proportions a chat model sees it: prose and
explanations, code in several languages, text in many scripts, and Kimi-K3's own chat format as its
template renders conversations (system, user, assistant with its thinking, tool declarations, tool
calls and their results). Every line here was written for k3lab (no text from elsewhere), so it is
under k3lab's licence (MIT); ``data/calibration-v1.txt`` is ``text()`` written out (``python -m
k3lab.kimi_k3.calibration_text > k3lab/kimi_k3/data/calibration-v1.txt``; a test holds it equal).
A new version gets a new file name: the text's SHA-256 is part of every imatrix made with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FILE = Path(__file__).with_name("data") / "calibration-v1.txt"

PROSE = [
    """Why does a lake freeze from the top down? Water is densest at about four degrees Celsius. As the
surface cools in autumn, the cold water sinks and warmer water rises, until the whole lake reaches four
degrees. After that, the surface keeps cooling but no longer sinks, because colder water is lighter. The
top layer reaches zero and turns to ice, and the ice floats and insulates the water beneath it, which is
why fish survive the winter at the bottom.""",
    """A good bug report says what you did, what you expected, and what happened instead. Include the exact
command, the version of every tool involved, and the smallest input that still shows the problem. If the
failure is intermittent, say how often it happens and what changes the odds. A maintainer who can
reproduce the issue in one minute will usually fix it the same day; one who cannot may never get to it.""",
    """The printing press did not spread literacy by itself. Books became cheaper, but reading still had to be
taught, and for two centuries most printed matter was religious or legal. What changed quickly was the
speed at which ideas could be copied without errors: a scholar in Venice and one in Basel could argue
about the same page, line by line, because both held an identical copy.""",
    """To estimate how long a trip by train takes, add the time on board, the time to reach the station, and
a margin for the connection. With a transfer of eight minutes and trains that run every half hour, the
expected delay from one missed connection is fifteen minutes on average, but thirty in the worst case.
Plan for the worst case when you have an appointment, and for the average when you do not.""",
    """Compound interest grows a sum by a fixed fraction each period. After n periods at rate r, an amount P
becomes P(1 + r)^n. At five percent a year, money doubles in a little over fourteen years, because
ln 2 / ln 1.05 is about 14.2. The rule of seventy-two gives the same answer in your head: 72 / 5 = 14.4.""",
    """Sourdough bread rises because wild yeast and lactic acid bacteria live together in the starter. The
yeast produces carbon dioxide, which lifts the dough, while the bacteria produce acids that give the
bread its sour taste and keep other microbes away. A cooler, longer fermentation makes the bread more
sour; a warmer, shorter one makes it milder and lighter.""",
    """When two people disagree about a plan, it helps to separate what each of them wants from how each
proposes to get it. Often they want the same outcome and only the route differs; sometimes the routes
are the same and the goals conflict. Naming which case you are in turns an argument into a decision.""",
    """Mixture-of-experts models route each token to a few specialised feed-forward networks out of many.
Only the chosen experts run, so a model with trillions of parameters can cost about as much per token as
a much smaller dense model. The router is trained with the experts; if it favours a few of them, the
others learn little, which is why training adds a penalty or a bias that spreads the load.""",
]

DIALOGUE = [
    (
        "How do I undo the last commit in git but keep my changes?",
        "Run git reset --soft HEAD~1. The commit disappears, and everything it changed stays staged, so you "
        "can edit the files and commit again. If you already pushed the commit, prefer git revert, which adds "
        "a new commit that undoes it without rewriting shared history.",
    ),
    (
        "What's the difference between a list and a tuple in Python?",
        "A list can change after it is made: you can append, remove, and replace items. A tuple cannot. "
        "Use a tuple for a fixed group of values, such as a point (x, y) or a key in a dictionary, and a list "
        "for a collection that grows or shrinks.",
    ),
    (
        "Give me three names for a small bakery by the sea.",
        "Salt & Crumb, The Harbour Oven, and Tide Loaf. Each hints at both the bread and the coast; Salt & "
        "Crumb is the shortest to put on a sign.",
    ),
    (
        "Translate 'the meeting has been moved to Thursday' into French and German.",
        "French: « La réunion a été déplacée à jeudi. » German: „Das Treffen wurde auf Donnerstag verlegt.“",
    ),
    (
        "Is 391 a prime number?",
        "No. 391 = 17 × 23. A quick way to check: its square root is just under 20, so you only need to try "
        "the primes up to 19, and 17 divides it.",
    ),
]

CODE = [
    '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping [start, end] intervals; the result is sorted and disjoint."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


assert merge_intervals([(1, 3), (2, 6), (8, 10), (9, 12)]) == [(1, 6), (8, 12)]
''',
    """#include <stdio.h>
#include <string.h>

/* Reverse a string in place and return it. */
static char *reverse(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n / 2; i++) {
        char t = s[i];
        s[i] = s[n - 1 - i];
        s[n - 1 - i] = t;
    }
    return s;
}

int main(void) {
    char word[] = "calibration";
    printf("%s\\n", reverse(word));
    return 0;
}
""",
    """use std::collections::HashMap;

/// Count how often each word occurs, ignoring case.
fn word_counts(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        *counts.entry(word.to_lowercase()).or_insert(0) += 1;
    }
    counts
}

fn main() {
    let counts = word_counts("the cat and the hat");
    println!("{:?}", counts.get("the"));
}
""",
    """// Debounce: call fn only after `wait` ms without another call.
function debounce(fn, wait) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), wait);
  };
}

const save = debounce((doc) => console.log("saving", doc.id), 300);
save({ id: 42 });
""",
    """-- Monthly revenue per region, highest first, for the last year.
SELECT region,
       date_trunc('month', ordered_at) AS month,
       SUM(quantity * unit_price)      AS revenue
FROM orders
JOIN customers USING (customer_id)
WHERE ordered_at >= now() - interval '1 year'
GROUP BY region, month
ORDER BY month, revenue DESC;
""",
    """#!/usr/bin/env bash
set -euo pipefail
# Keep the 7 newest backups, delete the rest.
cd /var/backups/site
ls -1t site-*.tar.gz | tail -n +8 | while read -r old; do
  echo "removing $old"
  rm -- "$old"
done
""",
    """package main

import (
	"fmt"
	"sync"
)

func main() {
	var wg sync.WaitGroup
	results := make([]int, 5)
	for i := range results {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			results[i] = i * i
		}(i)
	}
	wg.Wait()
	fmt.Println(results)
}
""",
    """{
  "name": "k3lab-example",
  "version": "1.2.0",
  "dependencies": {"numpy": ">=1.26", "gguf": "0.19.0"},
  "layers": [{"kind": "kda", "heads": 96}, {"kind": "mla", "kv_lora_rank": 512}]
}
""",
]

LANGUAGES = [
    "中文：春天来了，公园里的樱花都开了。周末我们一家人去散步，孩子们在草地上放风筝，老人坐在长椅上聊天。"
    "傍晚的时候起了一点风，我们买了热豆浆，慢慢走回家。",
    "中文：学习一门编程语言，最好的办法是做一个小项目。比如写一个记账程序：先能记录每天的开销，再按月份统计，"
    "最后画出一张图。遇到不懂的地方就查文档，一步一步来。",
    "日本語：駅から歩いて十分ほどのところに、小さな本屋があります。店主は古い地図を集めていて、頼めば"
    "昔の町の様子を話してくれます。",
    "한국어: 오늘은 비가 와서 집에서 책을 읽었습니다. 저녁에는 친구와 함께 김치찌개를 만들어 먹었어요.",
    "Français : Pour bien préparer un entretien, relisez l'offre, notez trois exemples concrets de vos "
    "réussites et préparez une question sur l'équipe. Arrivez dix minutes en avance.",
    "Deutsch: Der Zug nach Hamburg fährt heute ausnahmsweise von Gleis sieben ab. Bitte beachten Sie die "
    "geänderte Wagenreihung; die erste Klasse befindet sich am Ende des Zuges.",
    "Español: Si la planta tiene las hojas amarillas, probablemente recibe demasiada agua. Deja que la "
    "tierra se seque entre riegos y colócala cerca de una ventana con luz indirecta.",
    "Português: A feira abre às sete da manhã. Quem chega cedo encontra as frutas mais frescas e o melhor "
    "pão de queijo da cidade.",
    "Русский: Чтобы выучить новые слова, повторяйте их через день, потом через неделю, потом через месяц. "
    "Так память закрепляет их надолго.",
    "العربية: يبدأ المهرجان مساء الخميس في الساحة القديمة، وتُعرض فيه الحرف اليدوية والموسيقى الشعبية.",
    "हिन्दी: बारिश के मौसम में पहाड़ों की सड़कें फिसलन भरी हो जाती हैं, इसलिए धीरे चलें और मौसम की जानकारी लेते रहें।",
    "Italiano: Il segreto di un buon risotto è aggiungere il brodo caldo poco alla volta e mescolare con pazienza.",
    "Türkçe: Toplantıyı yarın saat onda yapalım; raporu önceden herkese gönderirim.",
    "Tiếng Việt: Buổi sáng ở Hà Nội bắt đầu bằng một bát phở nóng và tiếng xe máy trên phố.",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the project's documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]

CHATS: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "system", "content": "You are Kimi, a helpful assistant."},
            {"role": "user", "content": "Explain what a hash function is in two sentences."},
            {
                "role": "assistant",
                "reasoning_content": "Keep it short: mapping to fixed size, and the properties people rely on.",
                "content": "A hash function maps data of any size to a fixed-size value, so that the same input "
                "always gives the same output. Good ones make collisions rare and change the output "
                "completely when the input changes slightly.",
            },
            {"role": "user", "content": "And why do passwords use slow ones?"},
            {
                "role": "assistant",
                "reasoning_content": "Slowness defeats guessing at scale.",
                "content": "Because an attacker who steals the hashes tries billions of guesses; a deliberately "
                "slow hash such as Argon2 or bcrypt makes each guess expensive.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What's the weather in Lisbon? Use Celsius."},
            {
                "role": "assistant",
                "reasoning_content": "Call the weather tool for Lisbon in C.",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "C"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "name": "get_weather",
                "content": '{"temp": 19, "sky": "clear"}',
            },
            {
                "role": "assistant",
                "reasoning_content": "Report it plainly.",
                "content": "It's 19 °C and clear in Lisbon right now.",
            },
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "user", "content": "请用一句话解释什么是量化。"},
            {
                "role": "assistant",
                "reasoning_content": "用简单的话说明把高精度数字换成低精度表示。",
                "content": "量化就是用更少的比特来表示模型的权重，让模型更小、运行更快，同时尽量不损失精度。",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Find where the docs explain resuming a conversion."},
            {
                "role": "assistant",
                "reasoning_content": "Search the docs.",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "search_docs", "arguments": {"query": "resume conversion"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_7",
                "name": "search_docs",
                "content": "docs/converting.md: A stopped run keeps its finished files; the same command again converts the rest.",
            },
            {
                "role": "assistant",
                "reasoning_content": "Quote the relevant line.",
                "content": "docs/converting.md covers it: a stopped run keeps its finished files, and running the same "
                "command again converts only the rest.",
            },
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "user", "content": "Write a haiku about autumn rain."},
            {
                "role": "assistant",
                "content": "Cold rain on the roof\nthe maple lets go its red\none leaf at a time",
            },
        ],
        "thinking": False,
    },
]


def chats() -> list[str]:
    """The conversations as Kimi-K3's chat template renders them (k3lab's embedded template)."""
    from k3lab.kimi_k3 import chat

    out = []
    for c in CHATS:
        variables = {k: v for k, v in c.items() if k != "messages"}
        out.append(chat.render(c["messages"], **variables))
    return out


def text() -> str:
    """The whole text: each kind in turn, twice over in another order (a chunk of 512 tokens then
    holds several kinds)."""
    dialogue = [f"Q: {q}\nA: {a}" for q, a in DIALOGUE]
    parts = [*PROSE[:4], *CODE[:4], *LANGUAGES[:7], *chats()[:3], *dialogue[:3],
             *PROSE[4:], *CODE[4:], *LANGUAGES[7:], *chats()[3:], *dialogue[3:]]  # fmt: skip
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


if __name__ == "__main__":
    print(text(), end="")
