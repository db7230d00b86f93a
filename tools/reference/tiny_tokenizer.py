"""Tiny byte-level BPE tokenizer shared by the v3 fixtures and tools/random_checkpoint.py.

Trained with the Python `tokenizers` library on the original English text below (written for this
repository, no third-party text). Vocab = 512: id 0 = BOS, id 1 = EOS (DeepSeek spellings), then the
256 byte-level symbols, then 254 merges.
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
VOCAB_SIZE = 512

# Training corpus. Keep it stable: changing it changes every token id in the fixtures.
CORPUS = """\
The sperm whale, also called the cachalot, is the largest of the toothed whales and the largest toothed
predator on the planet. It dives deeper than almost any other mammal, hunting squid in the cold and dark
water far below the surface. A large male can hold its breath for more than an hour, and it finds its prey
by sound: it sends out loud clicks and listens for the echoes that come back from the animals around it.
The head of the whale holds a huge organ filled with a waxy oil, which early sailors mistook for something
else and which gave the animal its common English name.

Whales live in family groups. The females and their young stay together for many years, sharing the work
of watching the calves while the mothers dive for food. The males leave the group when they are young and
travel toward the poles, returning to warmer water only to find a mate. Each family has its own pattern of
clicks, a kind of dialect, and scientists who record these sounds can tell one clan from another even when
the animals are out of sight.

A language model is a program that reads a sequence of tokens and predicts the next one. The tokens are
small pieces of text: whole words when the word is common, and shorter pieces or single bytes when it is
rare. The model turns each token into a vector of numbers, mixes the vectors with attention so that every
position can look back at the positions before it, and then passes the result through a stack of layers.
At the end it produces a score for every token in the vocabulary, and the scores become probabilities.

A mixture of experts replaces the single feed forward block of a layer with many smaller blocks, called
experts, and a router that chooses a few of them for each token. Only the chosen experts do any work, so
the model can hold a very large number of parameters while spending only a small amount of compute on each
token. The router gives every expert a score, keeps the best ones, and mixes their outputs with weights
that come from the same scores. A shared expert sees every token and adds its output to the mix.

Latent attention stores a compressed vector for each past token instead of the full keys and values. The
compressed vector is expanded again when the attention scores are computed, or the expansion is folded
into the query so that the scores can be taken against the compressed vectors directly. This keeps the
cache small, which matters a great deal when the context is long and the machine has to read the whole
cache for every new token it writes.

To run such a model on an ordinary computer, the weights are stored with fewer bits. Eight bit floating
point numbers keep a sign, a small exponent and a few bits of mantissa, and a scale for each block of one
hundred and twenty eight by one hundred and twenty eight weights brings them back to their true size. The
program multiplies each stored value by the scale of its block before it uses the weight, or it folds the
scale into the result after the multiplication, which is cheaper and gives the same answer.

The old sailors told stories about the great white whale and the long voyages of the whaling ships. They
sailed for three or four years at a time, from the cold northern seas to the warm waters near the equator,
and they wrote down the weather, the wind and every animal they saw in their logbooks. Those books are now
read by people who study the ocean, because they show where the whales lived two hundred years ago, before
the hunting made them rare. Today the whales are protected, and their numbers are slowly growing again.

Numbers 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 7168 and symbols ( ) [ ] { } < > = + - * /
, . ; : ! ? ' " # % & _ | ~ @ $ appear in code and in text, so the tokenizer should know them as well.
"""


def build_tokenizer():
    """Train the tokenizer; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_config_json(model_max_length=8192):
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
