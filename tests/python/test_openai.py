"""The service through the official `openai` Python client, as users point it at us.

Run by scripts/test-python.sh (which builds the host and the component and installs the
client into a virtual environment): python -m unittest discover -s tests/python
"""
import json
import threading
import time
import unittest
import urllib.request

import openai

from harness import TEMPLATE, Server, fixture, log_softmax, wait_for

KEY = "test-key"


def setUpModule():
    global SERVER, BARE
    # the main server: a chat template and an API key
    SERVER = Server("--chat-template", TEMPLATE, "--api-key", KEY, "--max-concurrent", "8")
    # one guest at a time, no queue, no chat template, no key: for 429, chat without a
    # template and the graceful shutdown
    BARE = Server("--max-concurrent", "1", "--max-queue", "0", "--shutdown-grace", "20")


def tearDownModule():
    SERVER.stop()
    BARE.stop()


def client(server=None, key=KEY):
    return openai.OpenAI(base_url=(server or SERVER).url + "/v1", api_key=key, max_retries=0)


def tokenize(text):
    request = urllib.request.Request(
        SERVER.url + "/tokenize",
        data=json.dumps({"prompt": text}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + KEY},
    )
    with urllib.request.urlopen(request) as r:
        return json.load(r)["tokens"]


class Completions(unittest.TestCase):
    def test_plain_and_streamed_completions_agree(self):
        c = client()
        whole = c.completions.create(model="gpt2", prompt="ROMEO:", max_tokens=20, temperature=0)
        self.assertEqual(whole.object, "text_completion")
        self.assertEqual(whole.choices[0].finish_reason, "length")
        self.assertEqual(whole.usage.completion_tokens, 20)
        self.assertEqual(whole.usage.prompt_tokens, 3)
        chunks = list(
            c.completions.create(
                model="gpt2", prompt="ROMEO:", max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        self.assertEqual(text, whole.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, 20)
        self.assertEqual(chunks[-1].choices, [])
        # default max_tokens is 16, as OpenAI's
        self.assertEqual(c.completions.create(model="gpt2", prompt="ROMEO:").usage.completion_tokens, 16)

    def test_every_field(self):
        c = client()
        r = c.completions.create(
            model="gpt2", prompt="JULIET:", max_tokens=12, temperature=0.8, top_p=0.95, n=2, seed=7,
            stop=["\n\n"], presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"50256": -100},
            logprobs=3, echo=True, user="tester", best_of=2, suffix=None,
            extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [0]},
        )
        self.assertEqual([ch.index for ch in r.choices], [0, 1])
        for ch in r.choices:
            self.assertTrue(ch.text.startswith("JULIET:"), ch.text)
            lp = ch.logprobs
            self.assertIsNone(lp.token_logprobs[0])
            self.assertIsNone(lp.top_logprobs[0])
            self.assertEqual(len(lp.tokens), len(lp.token_logprobs))
            self.assertEqual(len(lp.tokens), len(lp.text_offset))
            for top in lp.top_logprobs[1:]:
                self.assertTrue(3 <= len(top) <= 4, top)
        # the same request again: the same choices (seeded)
        again = c.completions.create(
            model="gpt2", prompt="JULIET:", max_tokens=12, temperature=0.8, top_p=0.95, n=2, seed=7,
            stop=["\n\n"], presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"50256": -100},
            logprobs=3, echo=True,
            extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [0]},
        )
        self.assertEqual([ch.text for ch in again.choices], [ch.text for ch in r.choices])
        # streamed: every index's pieces and logprobs add up to the whole answer's
        texts, tokens = ["", ""], [[], []]
        for chunk in c.completions.create(
            model="gpt2", prompt="JULIET:", max_tokens=12, temperature=0.8, top_p=0.95, n=2, seed=7,
            stop=["\n\n"], presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"50256": -100},
            logprobs=3, echo=True, stream=True, stream_options={"include_usage": True},
            extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [0]},
        ):
            for ch in chunk.choices:
                texts[ch.index] += ch.text
                if ch.logprobs:
                    tokens[ch.index] += ch.logprobs.tokens
        self.assertEqual(texts, [ch.text for ch in r.choices])
        self.assertEqual(tokens, [ch.logprobs.tokens for ch in r.choices])

    def test_prompt_lists_and_token_ids(self):
        c = client()
        texts = c.completions.create(model="gpt2", prompt=["ROMEO:", "JULIET:"], max_tokens=8, temperature=0)
        ids = c.completions.create(
            model="gpt2", prompt=[tokenize("ROMEO:"), tokenize("JULIET:")], max_tokens=8, temperature=0
        )
        self.assertEqual([ch.text for ch in texts.choices], [ch.text for ch in ids.choices])
        single = c.completions.create(model="gpt2", prompt=tokenize("JULIET:"), max_tokens=8, temperature=0)
        self.assertEqual(single.choices[0].text, texts.choices[1].text)

    def test_logprobs_equal_hf(self):
        data, rows = fixture()
        c = client()
        for k, ids in enumerate(data["prompt_ids"]):
            hf = log_softmax(rows[k])
            r = c.completions.create(model="gpt2", prompt=ids, max_tokens=1, temperature=0, logprobs=5)
            lp = r.choices[0].logprobs
            chosen = data["greedy_64"][k][0]
            self.assertAlmostEqual(lp.token_logprobs[0], hf[chosen], delta=1e-4)
            best = sorted(range(len(hf)), key=lambda i: -hf[i])[:5]
            got = sorted(lp.top_logprobs[0].values(), reverse=True)[:5]
            for want, value in zip([hf[i] for i in best], got):
                self.assertAlmostEqual(value, want, delta=1e-4)
            # the prompt scored with echo: its last token after the fixture prompt
            r = c.completions.create(
                model="gpt2", prompt=ids + [chosen], max_tokens=0, echo=True, logprobs=1, temperature=0
            )
            self.assertAlmostEqual(r.choices[0].logprobs.token_logprobs[-1], hf[chosen], delta=1e-4)
            self.assertEqual(r.usage.completion_tokens, 0)

    def test_bad_requests_are_400s_that_say_why(self):
        c = client()
        cases = [
            (dict(prompt="x", temperature=3), "temperature"),
            (dict(prompt="x", suffix="tail"), "suffix"),
            (dict(prompt="x", best_of=3), "best_of"),
            (dict(prompt="x", logprobs=21), "logprobs"),
            (dict(prompt="x", extra_body={"foo": 1}), "foo"),
            (dict(prompt=[1, 99999]), "99999"),
            (dict(prompt=[198] * 500, max_tokens=100),
             "this model's maximum context length is 512 tokens; the request needs 600: 500 in the prompt, 100 to generate"),
            (dict(prompt=" a" * 600), "the prompt has 600 tokens"),
        ]
        for kwargs, mention in cases:
            with self.assertRaises(openai.BadRequestError, msg=str(kwargs)) as e:
                c.completions.create(model="gpt2", **kwargs)
            self.assertIn(mention, e.exception.message, kwargs)
        with self.assertRaises(openai.NotFoundError):
            c.completions.create(model="gpt-4", prompt="x")

    def test_a_generation_that_reaches_the_context_keeps_its_text(self):
        r = client().completions.create(model="gpt2", prompt=[198] * 500, temperature=0)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.total_tokens, 512)
        self.assertTrue(r.choices[0].text)

    def test_models_and_api_key(self):
        models = client().models.list()
        self.assertEqual([m.id for m in models.data], ["gpt2"])
        self.assertEqual(models.data[0].model_extra["max_model_len"], 512)
        with self.assertRaises(openai.AuthenticationError):
            client(key="wrong").completions.create(model="gpt2", prompt="x", max_tokens=1)

    def test_metrics_counters_move(self):
        def generated():
            text = SERVER.get("/metrics")
            return sum(
                float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("wasi_nn_generation_tokens_total")
            )

        before = generated()
        client().completions.create(model="gpt2", prompt="ROMEO:", max_tokens=7, temperature=0)
        self.assertGreaterEqual(generated() - before, 7)
        text = SERVER.get("/metrics")
        for name in ["wasi_nn_time_to_first_token_seconds_bucket", "wasi_nn_inter_token_seconds_bucket",
                     "wasi_nn_http_requests_total", "wasi_nn_guests_running", "wasi_nn_requests_queued"]:
            self.assertIn(name, text)


class Chat(unittest.TestCase):
    MESSAGES = [{"role": "system", "content": " A play. "}, {"role": "user", "content": "Speak."}]

    def test_chat_with_the_template(self):
        c = client()
        want = c.completions.create(
            model="gpt2", prompt="SYSTEM: A play.\nUSER: Speak.\nASSISTANT:", max_tokens=12, temperature=0
        )
        r = c.chat.completions.create(model="gpt2", messages=self.MESSAGES, max_tokens=12, temperature=0,
                                      logprobs=True, top_logprobs=2)
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.choices[0].message.content, want.choices[0].text)
        self.assertEqual(len(r.choices[0].logprobs.content), 12)
        self.assertEqual(len(r.choices[0].logprobs.content[0].top_logprobs), 2)
        stream = c.chat.completions.create(model="gpt2", messages=self.MESSAGES, max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertEqual(text, want.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, 12)

    def test_chat_without_a_template_is_a_400(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client(BARE).chat.completions.create(model="gpt2", messages=self.MESSAGES)
        self.assertIn("no chat template", e.exception.message)


class Operating(unittest.TestCase):
    """On the one-guest server: the queue's 429, then a graceful shutdown (last: it stops it)."""

    def test_queue_full_then_graceful_shutdown(self):
        c = client(BARE)
        got = {"text": "", "finish": None, "chunks": 0}
        first = threading.Event()

        def long_stream():
            for ch in c.completions.create(model="gpt2", prompt="ROMEO:", max_tokens=150, temperature=0,
                                           stream=True):
                if ch.choices:
                    got["text"] += ch.choices[0].text
                    got["finish"] = ch.choices[0].finish_reason or got["finish"]
                    got["chunks"] += 1
                    first.set()

        t = threading.Thread(target=long_stream)
        t.start()
        self.assertTrue(first.wait(60))
        # the one guest is busy and the queue holds none
        with self.assertRaises(openai.RateLimitError) as e:
            c.completions.create(model="gpt2", prompt="x", max_tokens=1)
        self.assertEqual(e.exception.response.headers.get("retry-after"), "1")
        # SIGTERM: no new connections, the stream in flight finishes, the process exits 0
        BARE.terminate()
        t.join(60)
        self.assertEqual(got["finish"], "length")
        want = client().completions.create(model="gpt2", prompt="ROMEO:", max_tokens=150, temperature=0)
        self.assertEqual(got["text"], want.choices[0].text)
        self.assertTrue(wait_for(lambda: BARE.proc.poll() is not None, 30), "".join(BARE.log))
        self.assertEqual(BARE.proc.returncode, 0, "".join(BARE.log))
        self.assertIn("SIGTERM", "".join(BARE.log))


if __name__ == "__main__":
    unittest.main()
