"""The self-distillation corpus for tools/train_mtp.py: chat prompts on many topics (parts
1-3, 5 and 6), raw-text openings without a chat template (part 4, tools/mtp_raw.py), and the
model's own greedy continuations of them (ignore_eos, as bench/spec_decode.py decodes), generated
with pdserve's engine.

Held out, for the training's evaluation: chat requests on HELD_OUT_TOPICS and
tools/mtp_raw.py's held-out raw openings. The bench's chat topics and the held-out topics
are kept out of the training topics (checked at import); the raw held-out openings share
no subject or code task with the training ones (checked at import and by
tests/tools/test_mtp_raw.py).
"""

from __future__ import annotations

import random
import time

TOPICS = [
    "the ocean", "volcanoes", "a small bakery", "machine learning", "the French revolution",
    "photosynthesis", "a lost dog", "black holes", "gardening tips", "the stock market",
    "healthy breakfast ideas", "the history of Rome", "learning to code in Python",
    "a trip to Japan", "climate change", "the human heart", "chess strategy",
    "writing a resume", "the moon landing", "electric cars", "honey bees", "jazz music",
    "a haunted house", "time management", "the water cycle", "ancient Egypt",
    "how vaccines work", "a birthday party", "mountain hiking", "renewable energy",
    "dinosaurs", "a job interview", "the solar system", "making pasta", "friendship",
    "the internet", "rainforests", "a detective story", "basic algebra", "sleep",
    "the immune system", "earthquakes", "the Roman army", "a farmer's market", "bread baking",
    "the Renaissance", "quantum physics", "wolves", "a rainy day", "meditation",
    "the Amazon river", "video games", "the piano", "recycling", "the Industrial Revolution",
    "a camping trip", "owls", "the Eiffel Tower", "DNA", "a dragon", "saving money",
    "the Vikings", "hurricanes", "coffee", "a first day at school", "elephants",
    "the Arctic", "a train journey",
    "the brain", "tornadoes", "Shakespeare", "a magic forest", "exercise", "the Moon",
    "rivers", "a small village", "cats", "the Cold War", "smartphones", "mushrooms",
    "a wedding", "nutrition", "the Mayan civilization", "kites",
    "glaciers", "a science fair", "the Sun", "butterflies", "volunteering", "the Middle Ages",
    "cloud computing", "sharks", "a snowy mountain",
    "the Wright brothers", "bird migration", "a library", "the theory of evolution",
    "cybersecurity", "a family dinner", "the Great Depression", "octopuses", "a thunderstorm",
    "the periodic table", "soccer", "a hot air balloon", "the samurai", "tigers",
    "writing an email", "the speed of light", "a treasure map", "composting",
    "the Silk Road", "artificial intelligence", "a carnival", "bats", "the human skeleton",
    "a road trip", "the Aztecs", "batteries", "a music festival", "gravity", "frogs",
    "the Titanic", "baking cookies", "the immune response to colds",
    "magnets", "horses", "rainbows",
    "public libraries", "the metric system", "a secret garden", "wind turbines",
    "the Statue of Liberty", "teamwork", "a fishing trip", "the Milky Way", "spiders",
    "democracy", "a clock maker", "the Nile", "starting a business", "whales", "fireworks",
    "the Internet of Things", "a castle", "the circulatory system", "skateboarding",
    "the history of flight", "a talking tree", "plastic pollution", "the Himalayas",
    "the first computers", "a market in Morocco", "ants", "the human eye", "a winter festival",
    "photography", "the Pyramids of Giza", "a bus driver", "learning to swim",
    "the French language", "a museum visit", "the Internet's history", "cheese making",
    "a superhero", "the lungs", "an old map",
    "databases", "a pumpkin patch", "the planets", "wildfires", "a jazz club", "rice farming",
    "the Beatles", "a time machine", "digestion", "a small boat", "microscopes",
    "the history of chocolate", "a lost key", "self-driving cars", "the Andes",
    "a grandmother's recipe", "cryptocurrency",
    "a football match", "the human voice", "a mystery letter", "sea turtles",
]
HELD_OUT_TOPICS = ["submarines", "origami", "the printing press", "a robot chef",
                   "desert animals", "public speaking", "hot springs", "the Dead Sea",
                   "the Sahara", "paper airplanes", "a night market", "ice hockey"]
# The first four are the bench's requests; the others widen the answer styles.
CHAT = ["Tell me about {t}.", "Write a short story about {t}.",
        "Explain {t} to a ten-year-old.", "Give me three facts about {t}.",
        "What are the pros and cons of {t}?", "Write a poem about {t}.",
        "Summarize the key ideas of {t} in a paragraph.", "Why is {t} important?",
        "Describe {t} in detail.", "Write a blog post about {t}."]
HELD_OUT_CHAT = CHAT[:4]

# The second corpus part (the head shipped since stop 10): more topics, more request
# styles, and the new styles on the first part's topics too, for about 3x the tokens.
EXTRA_TOPICS = [
    "a lemonade stand", "the Roman Colosseum", "kangaroos", "volleyball", "the stock exchange",
    "a mountain cabin", "penicillin", "the telephone", "a broken robot", "a city at night",
    "the printing of money", "polar bears", "sourdough bread", "a chess club", "tidal waves",
    "a dog show", "the Great Barrier Reef", "algebra homework", "a zoo keeper", "solar eclipses",
    "the history of the bicycle", "a violin maker", "a rainy Sunday", "crop rotation",
    "the Greek gods", "a lighthouse keeper's diary", "fossils", "a broken promise",
    "the first airplane flight", "a coffee shop", "electricity", "a desert island",
    "the Olympic torch", "lions", "the history of writing", "a spelling bee", "tsunamis",
    "the human stomach", "a birthday cake", "a hiking trail", "the ozone layer", "pottery",
    "a spaceship crew", "a forest fire ranger", "nuclear energy", "the Industrial age",
    "a treehouse", "plate tectonics", "giraffes", "a school play", "the radio", "calligraphy",
    "a market stall", "a storm at sea", "a new neighbour", "the kidneys", "dolphins",
    "the history of medicine", "a lost wallet", "a snowman", "the first Moon rover",
    "a robot dog", "yoga", "coral", "the Mississippi river", "a chocolate factory", "comets",
    "electric guitars", "a bakery in Paris", "the printing of books", "a magician",
    "sunflowers", "an abandoned train station", "the rule of law", "the Great Fire of London",
    "an ant colony", "a cooking competition", "the northern lights", "gold mining",
    "a vegetable garden", "the history of tea", "a quiet lake", "computer viruses",
    "a family reunion", "jellyfish", "a circus", "the Channel Tunnel", "parrots",
    "learning a new language", "a flower shop", "the bones of the hand", "bees and flowers",
    "a robot teacher", "the blue whale", "pirates of the Caribbean", "a haunted castle",
    "the Declaration of Independence", "a long winter", "rock climbing", "the ocean floor",
    "a lost city", "board games", "the first cars", "a city bus", "salt", "a mountain village",
    "recycling paper", "carbon dioxide", "an astronaut's day", "a kind stranger", "the desert",
    "the tides", "a marathon runner", "a honey farm", "the Golden Gate Bridge", "tomatoes",
    "a bookshop", "the history of money", "penguins' cousins the puffins", "wind and weather",
    "a missing cat", "a summer camp", "antibiotics", "a street musician", "human memory",
    "a small robot", "the Great Lakes", "the invention of the wheel", "a paper mill",
    "the night sky", "a rainy city", "a soccer coach", "the history of jeans", "cactus plants",
    "a young inventor", "the ocean currents", "the life of a bee", "a festival of lights",
    "an old clock", "volcanic islands", "electric bikes", "a medieval knight", "a pet hamster",
    "the Atlantic Ocean", "a secret tunnel", "the first photograph", "chemistry experiments",
    "a quiet morning", "the history of the Olympics", "a winter storm", "mountain goats",
]
EXTRA_CHAT = ["Can you explain how {t} works?", "Write a letter to a friend about {t}.",
              "List five interesting things about {t}.", "Write a news article about {t}.",
              "What would a day with {t} look like?", "Describe the history of {t}.",
              "Write a children's story about {t}.", "What should a beginner know about {t}?",
              "Compare {t} with something similar.", "Write a short essay on {t}."]


# Part 5 (issue 15): ten more request styles on every training topic, greedy as the rest.
MORE_CHAT = ["Write a dialogue between two friends about {t}.",
             "Give step-by-step instructions related to {t}.",
             "Answer the question: what is the most surprising fact about {t}?",
             "Write a FAQ with three questions and answers about {t}.",
             "Write a persuasive paragraph about {t}.", "Make an outline for a talk on {t}.",
             "Write a diary entry about {t}.", "Explain a common misconception about {t}.",
             "Write a short speech about {t}.", "Tell me a fun story involving {t}."]

# Part 6 (issue 15): new topics, each asked in the bench's four request styles (CHAT[:4])
# and four more drawn from the others. Kept apart from the bench's and held-out topics
# (check_disjoint checks the names; near ones, such as other lighthouse, tea or coral
# topics, were left out by hand).
NEW_TOPICS = [
    "a bridge builder", "the Panama Canal", "hummingbirds", "a candle maker",
    "the Atacama desert", "cardboard boxes", "a river delta", "the saxophone", "sea otters",
    "a glass blower", "the Hubble telescope", "fountain pens", "a hedgehog",
    "the Mongol empire", "clouds", "a blacksmith", "the Trans-Siberian railway", "snails",
    "a weather balloon", "the harp", "peacocks", "a sand castle", "the Roman roads", "lemurs",
    "a paper lantern", "the tuba", "hiking boots", "a quilt", "the Inca trail", "sloths",
    "a windmill", "fjords", "the cello", "a beekeeper's year", "the Suez Canal", "flamingos",
    "a typewriter", "the accordion", "raccoons", "a toy train", "the Alps", "a postman",
    "the Hanging Gardens", "otters", "a jigsaw puzzle", "the Colorado river",
    "a baker's dozen", "the flute", "chameleons", "a lantern festival", "the Rocky Mountains",
    "umbrellas", "koalas", "a cable car", "the Black Forest", "the trumpet", "a seed bank",
    "manatees", "a canoe trip", "the Grand Canyon", "a compass", "the drums", "hermit crabs",
    "a steam engine", "the Scottish Highlands", "a hot chocolate", "the Taj Mahal",
    "a paper boat", "the banjo", "ladybugs", "a weather vane", "the Okavango delta",
    "an hourglass", "the ukulele", "a herb garden", "Stonehenge", "fireflies",
    "a submarine cable", "the Sydney Opera House", "the clarinet", "a tide pool",
    "Machu Picchu", "a rocking chair", "red pandas", "a snow globe", "the Mekong river",
    "the oboe", "Antarctica", "a marble statue", "armadillos", "a pizza oven",
    "the Galapagos islands", "a pocket watch", "the xylophone", "porcupines",
    "a pottery wheel", "the Serengeti", "a sailboat race", "woodpeckers", "a mountain pass",
    "the bagpipes", "a spice market", "the Northwest Passage", "a cuckoo clock", "beavers",
    "the Louvre", "a hammock", "the mandolin", "a maple syrup farm", "Petra", "toucans",
    "a loom", "the Danube", "a puppet show", "the harmonica", "moose", "a rope bridge",
    "the Outback", "a teapot", "walruses", "the Forbidden City", "an orchard", "the organ",
    "a bird feeder", "the Dolomites", "a fountain", "pangolins", "a music box", "the Yukon",
    "a clay oven", "the bassoon", "seahorses", "a canal boat", "Angkor Wat", "a kaleidoscope",
    "the Gobi desert", "a greenhouse", "axolotls", "a paper map", "the Loch Ness legend",
    "a thimble", "the sitar", "meerkats", "a river ferry", "the Acropolis", "a wind chime",
    "the Everglades", "a leather satchel", "narwhals", "a tram ride", "the Mariana Trench",
    "a tin soldier", "the didgeridoo", "capybaras", "a village well", "the Kremlin",
    "a fountain pen repair", "the Great Plains", "a sundial", "tapirs", "a bookbinder",
    "the Caspian Sea", "a cottage garden", "the tambourine", "albatrosses", "a ski lift",
    "Easter Island", "a wooden spoon", "the Appalachian trail", "a rooftop garden",
    "the glockenspiel", "hippos", "a tailor's shop", "the Kalahari", "a mosaic",
    "the Victoria Falls", "a stone wall", "yaks", "the triangle instrument",
    "a street food stall", "the Rhine", "a recipe book", "chinchillas", "a crossword puzzle",
    "the Matterhorn", "a ship in a bottle", "the bass guitar", "a rice paddy", "lynxes",
    "a sculpture garden", "the Bay of Fundy", "the kazoo", "salamanders", "a flea market",
    "the Aral Sea", "a bamboo forest", "a model airplane", "the Yellowstone geysers",
    "a stained glass window", "the marimba", "puffer fish", "a village bakery",
    "the Black Sea", "the lute", "a radio tower", "wombats", "an ice cream van",
    "the Pacific islands", "a sewing machine", "the timpani", "a wildflower meadow",
    "the Yangtze river", "a mail train", "crows", "a treasure chest", "the Camino de Santiago",
    "a robot vacuum", "the piccolo", "a rooftop cafe", "cheetahs", "a paper crane",
    "the Dust Bowl", "a garden gnome", "the cathedral of Notre-Dame", "a goldfish",
    "an apple pie", "the Hoover Dam", "a wooden boat", "foxes", "the Sistine Chapel",
    "a barn owl", "a lemon tree", "the Berlin Wall", "a bus stop", "a tortoise",
    "the Alhambra", "a basket weaver", "the Norwegian coast", "a rain barrel",
    "a jellybean factory", "the Atlas mountains", "a scarecrow", "eagles", "a pencil",
    "the Thames", "a fire station", "a sea cave", "the Kon-Tiki voyage", "a bonsai tree",
    "the Lewis and Clark expedition", "a doorbell", "the Chernobyl exclusion zone",
    "a marching band", "an igloo", "the Rosetta Stone", "a skating rink", "hyenas",
    "the Mount Everest base camp", "a vending machine", "the Hindenburg", "a mouse in a barn",
    "the Hanseatic League", "a glacier lake", "a chimney sweep", "the Brooklyn Bridge",
    "a soap maker", "the Giant's Causeway", "an orange grove", "the Ottoman empire",
    "a potter's kiln", "the Lascaux caves", "a snow plow", "the Spanish armada",
    "a wishing well", "the Terracotta Army",
]

RAW_COUNT = 2400          # part 4's raw-text openings
# Parts 7 and 8 (tools/mtp_broad.py): requests per topic style, per word style, per raw
# kind; part 8 also asks each earlier style OLD_PER_STYLE times and OLD_RAW raw openings.
BROAD_COUNTS = {7: (24, 16, 30), 8: (10, 6, 10)}
OLD_PER_STYLE, OLD_RAW = 12, 200
# Answers of these parts are sampled (temperature, top-p); the others are greedy.
SAMPLED_PARTS = {8: (0.8, 0.95), 10: (0.8, 0.95)}
# Parts 9 and 10: requests and raw openings the target samples itself (tools/mtp_selfgen.py),
# each part its own draw (seeded by its number); part 10's answers are sampled. Built in
# tools/mtp_features.py, since their prompts need the model.
SELF_PARTS = (9, 10)
RAW_HELD_OUT = 64         # held-out raw-text openings (tools/mtp_raw.py held_out_raw_texts)


def _bench_topics() -> list[str]:
    try:
        from bench.spec_decode import TOPICS as bench_topics
    except ImportError:                 # an installed package without bench/
        return []
    return list(bench_topics)


def check_disjoint() -> None:
    """Training topics must not include the bench's or the held-out ones."""
    train = {t.lower() for t in TOPICS + EXTRA_TOPICS + NEW_TOPICS}
    if len(train) != len(TOPICS + EXTRA_TOPICS + NEW_TOPICS):
        raise ValueError("a training topic is listed twice (part 6's must be new)")
    for name, other in (("bench", _bench_topics()), ("held-out", HELD_OUT_TOPICS)):
        both = train & {t.lower() for t in other}
        if both:
            raise ValueError(f"training topics overlap the {name} topics: {sorted(both)}")


def chat_prompts(topics: list[str], templates: list[str], tokenizer,
                 per_topic: int, rng: random.Random,
                 used: set | None = None) -> list[list[int]]:
    """`per_topic` chat requests per topic (templates sampled without replacement); the
    (topic, template) pairs drawn go into `used`."""
    out = []
    for t in topics:
        for tmpl in rng.sample(templates, min(per_topic, len(templates))):
            out.append(encode_request(tokenizer, tmpl.format(t=t)))
            if used is not None:
                used.add((t, tmpl))
    return out


def unused_prompts(topics: list[str], templates: list[str], tokenizer,
                   used: set) -> list[list[int]]:
    """Every (topic, template) request not in `used`, in a fixed order."""
    return [encode_request(tokenizer, tmpl.format(t=t)) for t in topics for tmpl in templates
            if (t, tmpl) not in used]


def corpus_prompts(tokenizer, seed: int, num_topics: int, per_topic: int, parts,
                   raw_count: int = RAW_COUNT
                   ) -> tuple[dict[int, list[list[int]]], list[list[int]], list[list[int]]]:
    """({part: training prompts} for the parts asked for, held-out chat prompts, held-out
    raw-text prompts), drawn from `seed` in a fixed order, so a part's prompts (and cached
    answers) do not depend on which other parts are asked for.
    Part 1: TOPICS x CHAT, `per_topic` each; part 2: EXTRA_TOPICS x (CHAT + EXTRA_CHAT),
    `per_topic` + 2 each, and TOPICS x EXTRA_CHAT, 6 each; part 3: every pair of
    (TOPICS + EXTRA_TOPICS) x (CHAT + EXTRA_CHAT) not drawn yet; part 4: `raw_count`
    raw-text openings (tools/mtp_raw.py, no chat template, from seed + 4); part 5: every
    (TOPICS + EXTRA_TOPICS) x MORE_CHAT pair (no draw: the other parts are unchanged); part
    6: NEW_TOPICS x the bench's four styles (CHAT[:4]) and 4 more styles a topic, drawn from
    seed + 6."""
    from tools.mtp_raw import HELD_OUT_SEED, raw_prompts
    rng, used = random.Random(seed), set()
    topics = TOPICS[:num_topics]
    p1 = chat_prompts(topics, CHAT, tokenizer, per_topic, rng, used)
    held = chat_prompts(HELD_OUT_TOPICS, HELD_OUT_CHAT, tokenizer, len(HELD_OUT_CHAT), rng)
    p2 = (chat_prompts(EXTRA_TOPICS, CHAT + EXTRA_CHAT, tokenizer, per_topic + 2, rng, used)
          + chat_prompts(topics, EXTRA_CHAT, tokenizer, 6, rng, used))
    p3 = unused_prompts(topics + EXTRA_TOPICS, CHAT + EXTRA_CHAT, tokenizer, used)
    out = {1: p1, 2: p2, 3: p3}
    if 5 in parts:
        out[5] = unused_prompts(topics + EXTRA_TOPICS, MORE_CHAT, tokenizer, set())
    if 6 in parts:
        others = [c for c in CHAT + EXTRA_CHAT + MORE_CHAT if c not in HELD_OUT_CHAT]
        out[6] = (unused_prompts(NEW_TOPICS, HELD_OUT_CHAT, tokenizer, set())
                  + chat_prompts(NEW_TOPICS, others, tokenizer, 4, random.Random(seed + 6)))
    if 4 in parts:
        out[4] = raw_prompts(tokenizer, seed + 4, raw_count)
    for k in (7, 8):
        if k in parts:
            out[k] = broad_prompts(tokenizer, seed + k, k)
    held_raw = raw_prompts(tokenizer, HELD_OUT_SEED, RAW_HELD_OUT, held_out=True)
    return {k: out[k] for k in sorted(parts)}, held, held_raw


def broad_prompts(tokenizer, seed: int, part: int) -> list[list[int]]:
    """Part 7 or 8: tools/mtp_broad.py's many styles and raw kinds at small counts on every
    training topic; part 8 adds the earlier parts' styles and raw openings (its answers
    are sampled, SAMPLED_PARTS)."""
    from tools.mtp_broad import broad_texts
    from tools.mtp_raw import raw_texts
    chat, raw = broad_texts(seed, TOPICS + EXTRA_TOPICS + NEW_TOPICS, *BROAD_COUNTS[part])
    if part == 8:
        rng = random.Random(seed + 1)
        chat += [tmpl.format(t=t) for tmpl in CHAT + EXTRA_CHAT + MORE_CHAT
                 for t in rng.sample(TOPICS + EXTRA_TOPICS + NEW_TOPICS, OLD_PER_STYLE)]
        raw += raw_texts(seed + 2, OLD_RAW)
    return ([encode_request(tokenizer, r) for r in chat]
            + [tokenizer.encode(t) for t in raw])


def encode_request(tokenizer, request: str) -> list[int]:
    """A chat request as the engine's chat endpoint encodes it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": request}], True)
    return tokenizer.encode(text, add_special_tokens=False)


def generate_corpus(model_dir: str, prompts: list[list[int]], max_new: int, dtype: str,
                    batch: int, sampled: tuple[float, float] | None = None,
                    seed: int = 0) -> list[tuple[list[int], int]]:
    """ignore_eos answers, as (prompt + answer token ids, prompt length): greedy, or
    `sampled` at (temperature, top-p) with request i seeded `seed` + i."""
    from engine import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=8192,
              kv_cache_memory_gb=max(1.0, batch * (max_new + 96) * 24e3 / 1e9 * 1.2))
    if sampled is None:
        sp = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    else:
        sp = [SamplingParams(max_tokens=max_new, temperature=sampled[0], top_p=sampled[1],
                             seed=seed + i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=True)
    seqs = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
            for o in outs]
    n = sum(len(s) - p for s, p in seqs)
    how = "greedy" if sampled is None else f"sampled at {sampled}"
    print(f"generated {n} tokens in {time.time() - t0:.0f}s ({dtype}, batch {batch}, {how})",
          flush=True)
    return seqs


check_disjoint()
