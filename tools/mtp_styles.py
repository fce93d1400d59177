"""A held-out evaluation of the MTP head by request style and source (issue 39), frozen
before any training on it and never trained on.

The bench's chat set asks 16 topics in four request styles, and the corpus's part 6 asked
275 new topics in those same styles: the head learned them, so that set no longer measures
what a user sees. Here every request is written out whole (no topic x template grid), in
12 styles the corpus never uses, and raw text comes from kinds of source the corpus does
not draw on. bench/spec_decode.py `--sets styles` reports acceptance per style, so a weak
style shows instead of averaging away. tests/tools/test_mtp_styles.py checks that no
request here matches a corpus template or topic.
"""

from __future__ import annotations

STYLES: dict[str, list[str]] = {
    "rewrite": [
        "Rewrite this so it sounds friendlier: 'Your request has been denied. Do not reply.'",
        "Rewrite this paragraph in plain English: 'The aforementioned parties shall "
        "endeavour to remit payment forthwith upon receipt of the invoice.'",
        "Make this shorter without losing meaning: 'At this point in time we are currently "
        "in the process of reviewing all of the applications that we have received.'",
        "Rewrite this sentence in the passive voice: 'The committee approved the new budget "
        "on Monday.'",
        "Turn this note into a polite email to a coworker: 'meeting moved to 3, bring the "
        "slides, dont be late'",
        "Rewrite this for a five-year-old: 'Photosynthesis converts light energy into "
        "chemical energy stored in glucose.'",
    ],
    "continue_dialogue": [
        "Continue this conversation for four more lines.\nAnna: Did you lock the back door?"
        "\nBen: I thought you did.\nAnna:",
        "Continue the dialogue.\nCustomer: Hi, my order arrived broken.\nAgent: I'm sorry "
        "to hear that. Can you tell me what happened?\nCustomer:",
        "Keep this scene going.\nDetective: Where were you at nine o'clock?\nSuspect: At "
        "home, watching the game.\nDetective:",
        "Write the next few turns.\nTeacher: Who can tell me what a prime number is?\n"
        "Student:",
        "Continue.\nMom: Why is there flour all over the kitchen?\nKid:",
        "Finish this exchange.\nPilot: Tower, we have a small problem with the landing "
        "gear.\nTower:",
    ],
    "explain_code": [
        "What does this Python code do?\n\nnums = [3, 1, 2]\nprint(sorted(nums, "
        "reverse=True))",
        "Explain this JavaScript line by line:\n\nconst total = items.reduce((sum, x) => sum "
        "+ x.price, 0);",
        "What is wrong with this code?\n\nfor i in range(10)\n    print(i)",
        "Explain what this SQL query returns:\n\nSELECT name, COUNT(*) FROM orders GROUP BY "
        "name HAVING COUNT(*) > 2;",
        "What does this shell command do?\n\nfind . -name '*.log' -mtime +7 -delete",
        "Explain this C function:\n\nint max(int a, int b) { return a > b ? a : b; }",
    ],
    "numbered_plan": [
        "Give me a numbered plan to repaint a small bedroom over one weekend.",
        "Make a numbered checklist for moving to a new apartment.",
        "Plan a three-day trip to Lisbon as a numbered list.",
        "Write a numbered plan for teaching a puppy to walk on a leash.",
        "List, in order, the steps to change a flat bicycle tire.",
        "Give a numbered schedule for a productive study afternoon.",
    ],
    "complaint_letter": [
        "Write a formal complaint to my landlord about a heater that has been broken for "
        "two weeks.",
        "Draft a letter to an airline asking for a refund for a cancelled flight.",
        "Write a complaint to a restaurant about a delivery that arrived two hours late.",
        "Write a letter to the city council about potholes on Elm Street.",
        "Write to a phone company disputing a charge on my bill.",
        "Draft a letter to a school asking for a meeting about bus safety.",
    ],
    "text_table": [
        "Make a plain-text table of four musical instruments and the family each belongs to.",
        "Create a table in text with three fruits, their color and their price per kilo.",
        "Show a weekly workout schedule as a text table with days and exercises.",
        "Make a table comparing cats and dogs on size, cost and lifespan.",
        "Put these in a table: Paris France, Tokyo Japan, Cairo Egypt, Lima Peru.",
        "Draw a multiplication table for 1 to 5 in plain text.",
    ],
    "short_fact": [
        "What is the boiling point of water at sea level in Fahrenheit?",
        "Who wrote Pride and Prejudice?",
        "How many legs does a spider have?",
        "What is the capital of Canada?",
        "In which year did the first person walk on the moon?",
        "What gas do plants take in from the air?",
    ],
    "story_opening": [
        "Write only the first paragraph of a mystery set on a night train.",
        "Start a fantasy story with a girl who finds a key in a loaf of bread.",
        "Write the opening lines of a story told by an old lighthouse keeper's cat.",
        "Begin a science fiction story in which every clock on Earth stops at noon.",
        "Write the first scene of a story about two rival bakers.",
        "Open a ghost story in an empty school at midnight.",
    ],
    "product_description": [
        "Write a product description for a waterproof hiking backpack.",
        "Describe a stainless steel water bottle for an online store.",
        "Write a short listing for a handmade wool scarf.",
        "Describe a wireless computer mouse for a shopping website.",
        "Write a product blurb for a cast iron skillet.",
        "Describe a children's wooden puzzle for an online shop.",
    ],
    "compare_two": [
        "Compare trains and planes for a 500 km trip.",
        "What are the differences between a laptop and a tablet for a student?",
        "Compare renting and buying a home for a young couple.",
        "How is a crocodile different from an alligator?",
        "Compare running and swimming as exercise.",
        "Which is better for a beginner photographer, a phone or a camera?",
    ],
    "arithmetic": [
        "Solve step by step: a shirt costs $24 and is 25% off. What is the price?",
        "Work it out step by step: 17 times 23.",
        "A train travels 180 km in 2.5 hours. What is its average speed? Show your steps.",
        "If I save $15 a week, how many weeks until I have $240? Explain.",
        "Step by step: what is 3/4 plus 2/3?",
        "A recipe for 4 people needs 300 g of rice. How much for 10 people? Show the math.",
    ],
    "translate": [
        "Translate into French: 'Where is the train station?'",
        "Translate into Spanish: 'I would like a cup of coffee, please.'",
        "Translate into German: 'The weather is nice today.'",
        "How do you say 'thank you for your help' in Italian?",
        "Translate into Portuguese: 'My brother lives in a small town.'",
        "Translate into English: 'Je voudrais réserver une table pour deux.'",
    ],
}

# Raw text (no chat template, as the completions API gets it) from kinds of source the
# corpus's raw part does not draw on: recipes, terms of service, release notes, logs,
# sports reports.
RAW_SOURCES: dict[str, list[str]] = {
    "recipe": [
        "Ingredients: 2 cups flour, 1 tsp baking soda, 1/2 tsp salt, 1 cup butter.\n"
        "Instructions:\n1.",
        "Quick tomato soup\n\nServes 4. Prep time: 10 minutes.\n\nHeat the olive oil in a "
        "large pot and",
        "To make the glaze, whisk together the powdered sugar and",
        "Banana bread\n\nPreheat the oven to 350F. Grease a loaf pan. In a bowl, mash",
    ],
    "terms": [
        "TERMS OF SERVICE\n\n1. Acceptance of Terms. By accessing or using the Service, you",
        "Privacy Policy\n\nWe collect information you provide directly to us, such as",
        "4.2 Termination. Either party may terminate this Agreement upon thirty (30) days",
        "LIMITATION OF LIABILITY. IN NO EVENT SHALL THE COMPANY BE LIABLE FOR",
    ],
    "release_notes": [
        "## Version 2.4.0\n\n### Added\n- Dark mode for the settings page\n-",
        "Release notes 1.9.1\n\nBug fixes:\n* Fixed a crash when",
        "CHANGELOG\n\n## [3.0.0] - 2024-05-01\n### Breaking changes\n-",
        "What's new in this update:\n\n- Faster startup on older devices\n-",
    ],
    "log_lines": [
        "2024-03-01 12:00:01 INFO Server started on port 8080\n2024-03-01 12:00:02 INFO",
        "[WARN] Disk usage at 85% on /dev/sda1\n[WARN]",
        "Traceback (most recent call last):\n  File \"app.py\", line 12, in <module>\n",
        "GET /index.html 200 512ms\nGET /style.css 200 12ms\nGET",
    ],
    "sports_report": [
        "The home team opened the scoring in the 12th minute when",
        "In a tense final set, the defending champion",
        "With two minutes left on the clock and the score tied,",
        "The marathon began under grey skies as more than 20,000 runners",
    ],
}


def chat_requests() -> dict[str, list[str]]:
    return {style: list(reqs) for style, reqs in STYLES.items()}


def raw_texts() -> dict[str, list[str]]:
    return {source: list(texts) for source, texts in RAW_SOURCES.items()}
