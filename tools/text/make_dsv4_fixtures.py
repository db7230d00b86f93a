"""DeepSeek-V4 prompt-encoding fixtures for cachalot (`fixtures/text/v4_style/`, `fixtures/text/dsv4_cases.json`).

The oracle is DeepSeek's own encoder as shipped in the seed repository `hicann/cann-recipes-infer`
(HEAD fbc225d): `models/deepseek_v4/utils/encoding_dsv4.py` and its wrapper `models/deepseek_v4/utils/tokenizer.py`.
Nothing is downloaded here, and nothing of theirs is committed: put those two files, unchanged, into one folder
and pass it as SEED_DIR (default /tmp/dsv4), e.g.

    git --git-dir=<mirror> show HEAD:models/deepseek_v4/utils/encoding_dsv4.py > /tmp/dsv4/encoding_dsv4.py
    git --git-dir=<mirror> show HEAD:models/deepseek_v4/utils/tokenizer.py     > /tmp/dsv4/tokenizer.py

Run from the repository root:  /work/venv/ref/bin/python tools/text/make_dsv4_fixtures.py [SEED_DIR]
(transformers 5.24.0, tokenizers). Deterministic: a rerun gives identical files.

Builds:
  v4_style/tokenizer.json         the byte-level BPE of r1_style (fixtures/text/r1_style/tokenizer.json, made by
                                  make_text_fixtures.py) with DeepSeek-V4's special tokens at V4's ids
                                  (spec deepseek-v4.md §5: BOS 0, EOS 1, <｜User｜> 128803, ...), put both in the
                                  BPE vocab and in added_tokens so `tokenizers` keeps those ids
  v4_style/tokenizer_config.json  BOS/EOS names, no chat_template (V4 has none)
  v4_style/config.json            {"model_type": "deepseek_v4"}: what makes cachalot pick the V4 encoder
  dsv4_random_cases.json          "conversations": random conversations (all roles, tool calls and results with
                                  shuffled ids, tasks, wo_eos, tools, response formats) under random options with
                                  encode_messages' prompt; "completions": rendered assistant turns, intact and
                                  randomly cut or edited, with the parser's result or error; "context": each
                                  conversation cut at a random point, the tail encoded with the head as its
                                  `context`, or the error
  dsv4_cases.json                 "wrapper": conversations through the seed tokenizer wrapper's apply_chat_template
                                  (tokenize=False -> prompt, tokenize=True -> ids) on v4_style;
                                  "encode": direct encode_messages calls (all options);
                                  "encode_errors": inputs encode_messages rejects;
                                  "parse": completions and parse_message_from_completion_text's result or error
"""

import copy
import importlib
import json
import pathlib
import random
import sys
import types

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

SEED_DIR = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dsv4")
ROOT = pathlib.Path("fixtures/text")
OUT = ROOT / "v4_style"

# Load the seed's two files as a package (tokenizer.py imports `.encoding_dsv4`).
for f in ("encoding_dsv4.py", "tokenizer.py"):
    if not (SEED_DIR / f).exists():
        sys.exit(f"{SEED_DIR / f} is missing: copy models/deepseek_v4/utils/{f} of hicann/cann-recipes-infer there")
pkg = types.ModuleType("dsv4_seed")
pkg.__path__ = [str(SEED_DIR)]
sys.modules["dsv4_seed"] = pkg
enc = importlib.import_module("dsv4_seed.encoding_dsv4")
seed_tok = importlib.import_module("dsv4_seed.tokenizer")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

# (content, id, special) as in spec deepseek-v4.md §5.
V4_SPECIALS = [
    (BOS, 0, True),
    (EOS, 1, True),
    ("<｜User｜>", 128803, False),
    ("<｜Assistant｜>", 128804, False),
    ("<think>", 128821, False),
    ("</think>", 128822, False),
    ("｜DSML｜", 128825, False),
    ("<｜latest_reminder｜>", 128828, False),
    ("<｜action｜>", 128829, False),
    ("<｜query｜>", 128830, False),
    ("<｜authority｜>", 128831, False),
    ("<｜domain｜>", 128832, False),
    ("<｜title｜>", 128836, False),
    ("<｜read_url｜>", 128845, False),
]


def build_tokenizer():
    t = json.loads((ROOT / "r1_style" / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = t["model"]["vocab"]
    # Drop r1_style's own added tokens from the vocab (ids 0 and 1 stay BOS/EOS), then add V4's.
    for added in t["added_tokens"]:
        if added["id"] > 1:
            vocab.pop(added["content"], None)
    added = []
    for content, tid, special in V4_SPECIALS:
        vocab[content] = tid
        added.append({"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": special})
    t["added_tokens"] = added
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False) + "\n", encoding="utf-8")
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
              "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"}
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (OUT / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}, indent=2) + "\n", encoding="utf-8")
    tok = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    for content, tid, _ in V4_SPECIALS:
        assert tok.token_to_id(content) == tid, content
    return tok


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, in °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}}}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Zürich, then search?"},
    {"role": "assistant", "reasoning_content": "Two cities: call both.", "content": "",
     "tool_calls": [call("c1", "get_weather", json.dumps({"city": "Paris", "days": 3})),
                    call("c2", "get_weather", json.dumps({"city": "Zürich", "days": 1.5, "metric": True,
                                                          "hours": [6, 12], "opts": {"lang": "dé", "x": None}},
                                                         ensure_ascii=False))]},
    # Results arrive out of call order: the encoder sorts them back.
    {"role": "tool", "tool_call_id": "c2", "content": "Zürich: 12°C"},
    {"role": "tool", "tool_call_id": "c1", "content": "Paris: 15°C"},
    {"role": "assistant", "reasoning_content": "Now search.", "content": "Looking it up.",
     "tool_calls": [call("c3", "search", '{"q": "whales", "filters": {"year": 2024, "ratio": 1e-07, "big": 1e+20}}')]},
    {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "result one"},
                                                       {"type": "image_url", "image_url": {"url": "x"}},
                                                       {"type": "text", "text": "result two"}]},
    {"role": "user", "content": "Thanks. Summarise."},
]

MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "reasoning_content": "Again.", "content": "6"},
    {"role": "user", "content": "And 4+4?"},
]


def wrapper_cases():
    """(name, messages, tools, kwargs) for the seed wrapper's apply_chat_template."""
    return [
        ("chat_single", [{"role": "user", "content": "Hi"}], None, {}),
        ("thinking_single", [{"role": "user", "content": "Hi"}], None, {"enable_thinking": True}),
        ("thinking_kwarg", [{"role": "user", "content": "Hi"}], None, {"thinking": True}),
        ("system_user_chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}], None, {}),
        ("multi_turn_chat", MULTI, None, {}),
        ("multi_turn_thinking_drop", MULTI, None, {"enable_thinking": True}),
        ("multi_turn_thinking_keep", MULTI, None, {"enable_thinking": True, "drop_thinking": False}),
        ("multi_turn_ending_with_assistant", MULTI[:5], None, {"enable_thinking": True}),
        ("tools_thinking", TOOL_TURNS, [WEATHER, SEARCH], {"enable_thinking": True}),
        ("tools_chat", TOOL_TURNS, [WEATHER, SEARCH], {}),
        ("tools_effort_max", TOOL_TURNS[:1], [WEATHER], {"enable_thinking": True, "reasoning_effort": "max"}),
        ("effort_max", [{"role": "user", "content": "Prove it."}], None, {"enable_thinking": True, "reasoning_effort": "max"}),
        ("effort_xhigh", [{"role": "system", "content": "S"}, {"role": "user", "content": "Prove it."}], None, {"enable_thinking": True, "reasoning_effort": "xhigh"}),
        ("effort_high", [{"role": "user", "content": "Prove it."}], None, {"enable_thinking": True, "reasoning_effort": "medium"}),
        ("effort_none_forces_chat", [{"role": "user", "content": "Prove it."}], None, {"enable_thinking": True, "reasoning_effort": "none"}),
        ("effort_max_in_chat_mode", [{"role": "user", "content": "Prove it."}], None, {"reasoning_effort": "max"}),
        ("effort_not_a_string", [{"role": "user", "content": "Prove it."}], None, {"enable_thinking": True, "reasoning_effort": 3}),
        ("unicode_and_markup", [{"role": "user", "content": "抹香鲸 🐋 <b>x</b> \"q\" \\n"}], None, {"enable_thinking": True}),
    ]


def encode_cases():
    """(name, messages, thinking_mode, drop_thinking, add_bos, reasoning_effort) for encode_messages."""
    dev_tools = {"role": "developer", "content": "Use the tools.", "tools": [WEATHER],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}}
    return [
        ("no_bos", [{"role": "user", "content": "Hi"}], "chat", True, False, None),
        ("effort_high_direct", [{"role": "user", "content": "Hi"}], "thinking", True, True, "high"),
        ("system_response_format", [{"role": "system", "content": "Reply in JSON.",
                                     "response_format": {"type": "object", "properties": {"a": {"type": "number"}}}},
                                    {"role": "user", "content": "Give a."}], "thinking", True, True, None),
        ("system_tools_and_format", [{"role": "system", "content": "", "tools": [SEARCH],
                                      "response_format": {"type": "object"}},
                                     {"role": "user", "content": "Go."}], "chat", True, True, None),
        ("developer_tools_format", [dev_tools, {"role": "user", "content": "Paris?"}], "thinking", True, True, None),
        ("developer_last", [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "r", "content": "Hello"},
                            {"role": "developer", "content": "Now be formal."}], "thinking", True, True, None),
        ("developer_dropped_before_last_user",
         [{"role": "developer", "content": "Old rule."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "reasoning_content": "r", "content": "Hello"},
          {"role": "developer", "content": "New rule."}, {"role": "assistant", "content": "Ok"},
          {"role": "user", "content": "Go"}], "thinking", True, True, None),
        ("developer_kept_without_drop",
         [{"role": "developer", "content": "Old rule."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "reasoning_content": "r", "content": "Hello"}, {"role": "user", "content": "Go"}],
         "thinking", False, True, None),
        ("latest_reminder_after_user",
         [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
          {"role": "latest_reminder", "content": "Today is Monday."}], "thinking", True, True, None),
        ("latest_reminder_before_user",
         [{"role": "latest_reminder", "content": "Today is Monday."}, {"role": "user", "content": "Q"}], "chat", True, True, None),
        ("latest_reminder_then_assistant",
         [{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "R"},
          {"role": "assistant", "reasoning_content": "t", "content": "A"}, {"role": "user", "content": "Q2"}],
         "thinking", True, True, None),
        ("task_action_thinking", [{"role": "user", "content": "Book a table.", "task": "action"}], "thinking", True, True, None),
        ("task_action_chat", [{"role": "user", "content": "Book a table.", "task": "action"}], "chat", True, True, None),
        ("task_action_answered",
         [{"role": "user", "content": "Book a table.", "task": "action"},
          {"role": "assistant", "reasoning_content": "ignored", "content": "SEARCH"}], "thinking", True, True, None),
        ("task_query", [{"role": "user", "content": "whales", "task": "query"}], "thinking", True, True, None),
        ("task_authority", [{"role": "user", "content": "x", "task": "authority"}], "chat", True, True, None),
        ("task_domain", [{"role": "user", "content": "x", "task": "domain"}], "chat", True, True, None),
        ("task_title", [{"role": "user", "content": "x", "task": "title"}], "chat", True, True, None),
        ("task_read_url", [{"role": "user", "content": "x", "task": "read_url"},
                           {"role": "assistant", "content": "https://example.org"}], "thinking", True, True, None),
        ("task_then_user_not_merged",
         [{"role": "user", "content": "a", "task": "query"}, {"role": "user", "content": "b"}], "chat", True, True, None),
        ("users_merge_and_task_lost",
         [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "task": "title"}], "chat", True, True, None),
        ("tool_results_then_user_text",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "g", '{"x": "y"}')]},
          {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
          {"role": "user", "content": "and then?"}], "thinking", True, True, None),
        ("tool_results_unknown_ids",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}"), call("b", "g", "{}")]},
          {"role": "tool", "tool_call_id": "zz", "content": "Z"}, {"role": "tool", "tool_call_id": "b", "content": "B"},
          {"role": "tool", "content": "none"}, {"role": "tool", "tool_call_id": "a", "content": "A"}],
         "chat", True, True, None),
        ("tool_call_id_in_function",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"type": "function", "function": {"id": "p", "name": "f", "arguments": "{}"}},
              {"type": "function", "function": {"id": "q", "name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "q", "content": "Q"}, {"role": "tool", "tool_call_id": "p", "content": "P"}],
         "chat", True, True, None),
        ("tool_call_arguments_not_json",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "ok", "tool_calls": [call("a", "shell", "ls -la | head")]},
          {"role": "tool", "tool_call_id": "a", "content": "file"}], "chat", True, True, None),
        ("tool_call_arguments_object",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [call("a", "f", {"k": "v", "n": 2})]}], "chat", True, True, None),
        ("tool_then_user_with_task",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "{}")]},
          {"role": "tool", "tool_call_id": "a", "content": "A"}, {"role": "user", "content": "q", "task": "query"}],
         "chat", True, True, None),
        ("assistant_wo_eos",
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "hm", "content": "Hel", "wo_eos": True}],
         "thinking", True, True, None),
        ("assistant_null_content",
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call("a", "f", '{"s": "\\n\\"q\\""}')]}],
         "thinking", True, True, None),
        ("system_only", [{"role": "system", "content": "S"}], "thinking", True, True, None),
        ("empty", [], "thinking", True, True, None),
        ("effort_max_system_first", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "thinking", True, True, "max"),
        ("effort_max_no_bos", [{"role": "user", "content": "Q"}], "thinking", True, False, "max"),
        ("floats_in_arguments",
         [{"role": "user", "content": "go"},
          {"role": "assistant", "content": "", "tool_calls": [call("a", "f",
                                                                   '{"a": 0.1, "b": 1e16, "c": 1.5e-5, "d": -0.0, "e": 123456789.125, "f": 1E+3, "g": 12345678901234567890, "h": 0.0001, "i": 2.5e15}')]}],
         "chat", True, True, None),
    ]


def encode_error_cases():
    return [
        ("invalid_task", [{"role": "user", "content": "x", "task": "summarise"}], "chat"),
        ("developer_empty", [{"role": "developer", "content": ""}, {"role": "user", "content": "x"}], "chat"),
        ("unknown_role", [{"role": "narrator", "content": "x"}], "chat"),
        ("arguments_not_an_object", [{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": "", "tool_calls": [call("a", "f", "[1, 2]")]}], "chat"),
        ("tool_without_function", [{"role": "system", "content": "", "tools": [{"type": "function", "name": "f"}]},
                                   {"role": "user", "content": "x"}], "chat"),
    ]


def parse_cases():
    dsml = "｜DSML｜"
    tc = (f"\n\n<{dsml}tool_calls>\n<{dsml}invoke name=\"get_weather\">\n"
          f"<{dsml}parameter name=\"city\" string=\"true\">Zürich</{dsml}parameter>\n"
          f"<{dsml}parameter name=\"days\" string=\"false\">2</{dsml}parameter>\n"
          f"<{dsml}parameter name=\"opts\" string=\"false\">{{\"lang\": \"dé\"}}</{dsml}parameter>\n"
          f"</{dsml}invoke>\n<{dsml}invoke name=\"search\">\n"
          f"<{dsml}parameter name=\"q\" string=\"true\">a \"quoted\"\nline</{dsml}parameter>\n"
          f"</{dsml}invoke>\n</{dsml}tool_calls>")
    no_params = f"\n\n<{dsml}tool_calls>\n<{dsml}invoke name=\"now\">\n</{dsml}invoke>\n</{dsml}tool_calls>"
    return [
        ("thinking_answer", "Let me think.</think>The answer is 4." + EOS, "thinking"),
        ("chat_answer", "The answer is 4." + EOS, "chat"),
        ("thinking_empty_reasoning", "</think>Hi" + EOS, "thinking"),
        ("thinking_tool_calls", "Need weather.</think>Checking." + tc + EOS, "thinking"),
        ("chat_tool_calls_no_eos", tc, "chat"),
        ("chat_tool_call_no_params", no_params + EOS, "chat"),
        ("thinking_multiline", "a\nb\n\nc</think>\n\nx\ny" + EOS, "thinking"),
        ("err_missing_think_end", "no end" + EOS, "thinking"),
        ("err_missing_eos", "The answer", "chat"),
        ("err_text_after_eos", "A" + EOS + "B", "chat"),
        ("err_think_in_content", "r</think>a</think>b" + EOS, "thinking"),
        ("err_bos_in_content", "a" + BOS + "b" + EOS, "chat"),
        ("err_think_open_in_reasoning", "<think>r</think>a" + EOS, "thinking"),
        ("err_dsml_in_content", "a ｜DSML｜ b" + EOS, "chat"),
        ("err_tool_calls_before_think_end", "r" + tc + EOS, "thinking"),
        ("err_text_after_tool_calls", tc + "more" + EOS, "chat"),
        ("err_bad_separator", tc.replace(f">\n<{dsml}invoke", f">\n\n<{dsml}invoke", 1) + EOS, "chat"),
        ("err_bad_string_flag", tc.replace('string="true"', 'string="yes"', 1) + EOS, "chat"),
        ("err_duplicate_parameter", tc.replace('name="days"', 'name="city"', 1) + EOS, "chat"),
        ("err_bad_invoke_name", tc.replace('invoke name="search"', 'invoke nam="search"', 1) + EOS, "chat"),
        ("err_bad_after_parameter", tc.replace(f"</{dsml}parameter>\n</{dsml}invoke>", f"</{dsml}parameter> \n</{dsml}invoke>", 1) + EOS, "chat"),
    ]


def random_cases(n_conversations=110, n_completions=260, seed=1):
    """Random conversations and (edited) completions, both through the seed's functions."""
    rng = random.Random(seed)
    words = ["a", "b c", "é", "\n", "x\n\ny", "<b>", "\"q\"", "", "tool", "🐋"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    def text():
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 3)))

    def arguments():
        if rng.random() < 0.1:
            return "not json " + text()
        values = {"s": text, "n": lambda: rng.randint(-5, 5), "b": lambda: rng.random() < 0.5,
                  "l": lambda: [1, "x"], "o": lambda: {"k": text()}, "f": lambda: rng.choice([0.5, 1e-7, 3.0, 1e22])}
        keys = rng.sample(sorted(values), rng.randint(0, 4))
        return json.dumps({k: values[k]() for k in keys}, ensure_ascii=rng.random() < 0.5)

    conversations, assistants = [], []
    roles = ["system", "user", "user", "assistant", "assistant", "tool", "tool", "developer", "latest_reminder"]
    for _ in range(n_conversations):
        messages, call_ids = [], []
        for _ in range(rng.randint(0, 8)):
            role = rng.choice(roles)
            m = {"role": role}
            if role == "tool":
                m["tool_call_id"] = rng.choice(call_ids + ["zz", ""]) if call_ids else "q"
                m["content"] = text() if rng.random() < 0.8 else [{"type": "text", "text": text()}, {"type": "image"}]
            else:
                m["content"] = text() if role != "developer" else "dev" + text()
            if role == "assistant":
                if rng.random() < 0.6:
                    m["reasoning_content"] = text()
                if rng.random() < 0.4:
                    calls = []
                    for _ in range(rng.randint(1, 3)):
                        cid = f"c{rng.randint(0, 5)}"
                        call_ids.append(cid)
                        calls.append(call(cid, rng.choice(["f", "g"]), arguments()))
                    m["tool_calls"] = calls
                if rng.random() < 0.1:
                    m["wo_eos"] = True
                else:
                    assistants.append(m)
            if role in ("system", "developer") and rng.random() < 0.2:
                m["tools"] = [tool]
            if role in ("system", "developer") and rng.random() < 0.2:
                m["response_format"] = {"type": "object"}
            if rng.random() < 0.12:
                m["task"] = rng.choice(sorted(enc.VALID_TASKS))
            messages.append(m)
        opts = {"thinking_mode": rng.choice(["chat", "thinking"]), "drop_thinking": rng.random() < 0.7,
                "add_bos": rng.random() < 0.9, "reasoning_effort": rng.choice([None, None, "high", "max"])}
        prompt = enc.encode_messages(copy.deepcopy(messages), thinking_mode=opts["thinking_mode"],
                                     drop_thinking=opts["drop_thinking"], add_default_bos_token=opts["add_bos"],
                                     reasoning_effort=opts["reasoning_effort"])
        conversations.append({"messages": messages, **opts, "prompt": prompt})

    pieces = ["\n", ">", "<", "\"", " ", "｜DSML｜", "</think>", EOS, 'string="true"', 'name="', "/｜DSML｜parameter"]
    completions = []
    while len(completions) < n_completions:
        m, mode = rng.choice(assistants), rng.choice(["chat", "thinking"])
        user = [{"role": "user", "content": "q"}]
        base = enc.encode_messages(user, thinking_mode=mode, drop_thinking=False)
        full = enc.encode_messages(user + [copy.deepcopy(m)], thinking_mode=mode, drop_thinking=False)
        t = full[len(base):]
        k, op = rng.randint(0, len(t)), rng.random()
        if op < 0.25:
            pass
        elif op < 0.5:
            t = t[:k] + t[k + 1:]
        elif op < 0.8:
            t = t[:k] + rng.choice(pieces) + t[k:]
        else:
            t = t[:k]
        try:
            result, error = enc.parse_message_from_completion_text(t, thinking_mode=mode), None
        except (AssertionError, ValueError) as e:
            result, error = None, f"{type(e).__name__}: {e}"
        completions.append({"text": t, "thinking_mode": mode, "result": result, "python_error": error})
    return {"conversations": conversations, "completions": completions,
            "context": context_cases(conversations)}


def context_cases(conversations, seed=7):
    """Each random conversation of two messages or more cut at a random point: encode_messages of the
    tail with the head as its `context` (the already-encoded prefix), or the error it raises."""
    rng = random.Random(seed)
    out = []
    for i, c in enumerate(conversations):
        n = len(c["messages"])
        if n < 2:
            continue
        k = rng.randint(1, n - 1)
        try:
            prompt = enc.encode_messages(copy.deepcopy(c["messages"][k:]), thinking_mode=c["thinking_mode"],
                                         context=copy.deepcopy(c["messages"][:k]),
                                         drop_thinking=c["drop_thinking"], add_default_bos_token=c["add_bos"],
                                         reasoning_effort=c["reasoning_effort"])
            error = None
        except Exception as e:  # noqa: BLE001 - the Rust side must refuse the same inputs
            prompt, error = None, type(e).__name__
        out.append({"conversation": i, "split": k, "prompt": prompt, "python_error": error})
    return out


def main():
    tok = build_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(OUT / "tokenizer.json"), bos_token=BOS, eos_token=EOS)
    v4 = seed_tok.get_deepseek_v4_tokenizer(hf)
    out = {"source": "hicann/cann-recipes-infer fbc225d models/deepseek_v4/utils/{encoding_dsv4,tokenizer}.py",
           "wrapper": [], "encode": [], "encode_errors": [], "parse": []}
    for name, messages, tools, kwargs in wrapper_cases():
        prompt = v4.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=False, **kwargs)
        ids = v4.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        assert ids == tok.encode(prompt, add_special_tokens=False).ids, name
        out["wrapper"].append({"name": name, "messages": messages, "tools": tools, "kwargs": kwargs,
                               "prompt": prompt, "ids": ids})
    for name, messages, mode, drop, bos, effort in encode_cases():
        prompt = enc.encode_messages(copy.deepcopy(messages), thinking_mode=mode, drop_thinking=drop,
                                     add_default_bos_token=bos, reasoning_effort=effort)
        out["encode"].append({"name": name, "messages": messages, "thinking_mode": mode, "drop_thinking": drop,
                              "add_bos": bos, "reasoning_effort": effort, "prompt": prompt,
                              "ids": tok.encode(prompt, add_special_tokens=False).ids})
    for name, messages, mode in encode_error_cases():
        try:
            enc.encode_messages(copy.deepcopy(messages), thinking_mode=mode)
        except Exception as e:  # the oracle must reject these
            # The message up to ". Valid tasks are: {set}", whose order changes from run to run.
            message = str(e).split(". Valid")[0]
            out["encode_errors"].append({"name": name, "messages": messages, "thinking_mode": mode,
                                         "python_error": f"{type(e).__name__}: {message}"})
        else:
            sys.exit(f"encode error case {name}: the seed encoder accepted it")
    for name, text, mode in parse_cases():
        try:
            result = enc.parse_message_from_completion_text(text, thinking_mode=mode)
            error = None
        except (AssertionError, ValueError) as e:
            result, error = None, f"{type(e).__name__}: {e}"
        assert (error is None) == (not name.startswith("err_")), (name, error)
        out["parse"].append({"name": name, "text": text, "thinking_mode": mode, "result": result, "python_error": error})
    (ROOT / "dsv4_cases.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    rand = random_cases()
    (ROOT / "dsv4_random_cases.json").write_text(json.dumps(rand, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT}/ and {ROOT / 'dsv4_cases.json'}: {len(out['wrapper'])} wrapper, {len(out['encode'])} encode, "
          f"{len(out['encode_errors'])} encode-error, {len(out['parse'])} parse cases; "
          f"{len(rand['conversations'])} random conversations, {len(rand['completions'])} random completions, "
          f"{len(rand['context'])} of them cut into context and tail")


if __name__ == "__main__":
    main()
