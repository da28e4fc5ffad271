"""Word lists of the bundled prompt set's task templates (written for this project): topics,
names, places, sentences, opposites, colours, goals, animals. Changing one changes the bundled
prompts and the embedded targets' training text (both rebuild byte-identically from them)."""

from __future__ import annotations

TOPICS: dict[str, tuple[str, str]] = {
    "photosynthesis": ("process in green plants", "turn sunlight into food"),
    "a rainbow": ("band of colored light", "show how light splits into colors"),
    "gravity": ("force between masses", "keep planets in their orbits"),
    "a compass": ("tool with a magnetic needle", "find the direction north"),
    "a battery": ("store of chemical energy", "power small devices"),
    "recycling": ("way to reuse old materials", "reduce waste"),
    "a volcano": ("opening in the ground", "release hot rock from deep below"),
    "the moon": ("natural satellite", "light the night and move the tides"),
    "a bridge": ("structure over a gap", "let people cross rivers and roads"),
    "a library": ("collection of books", "let people read and learn for free"),
    "a thermometer": ("tool for measuring heat", "tell how warm or cold something is"),
    "a map": ("drawing of a place", "help people find their way"),
    "vaccination": ("way to train the body", "protect people from disease"),
    "a calendar": ("chart of days and months", "plan events in time"),
    "electricity": ("flow of charge", "run lights and machines"),
    "a seed": ("small part of a plant", "grow a new plant"),
    "the internet": ("network of computers", "share information around the world"),
    "a clock": ("device that shows time", "keep track of hours and minutes"),
    "an orchestra": ("large group of musicians", "play music together"),
    "a telescope": ("tool with lenses or mirrors", "see distant stars"),
    "composting": ("way to break down food scraps", "make rich soil for gardens"),
    "a lighthouse": ("tall tower with a bright lamp", "guide ships at night"),
    "a dictionary": ("book of words and meanings", "look up what words mean"),
    "friction": ("force between touching surfaces", "slow down moving things"),
    "a glacier": ("large river of ice", "carve valleys over many years"),
    "a recipe": ("list of steps for cooking", "make the same dish again"),
    "an umbrella": ("folding cover", "keep the rain off"),
    "a museum": ("building with old and rare objects", "show history and art"),
    "saving money": ("habit of keeping some income", "be ready for future needs"),
    "a spreadsheet": ("grid of rows and columns", "organise numbers and lists"),
}

ASK_TOPIC = [
    "Explain {topic} in simple words.",
    "What is {topic}?",
    "Can you tell me about {topic}?",
    "I never understood {topic}. Could you help?",
    "Give me a short explanation of {topic}, please.",
]

WORDS = [
    "apple",
    "river",
    "window",
    "garden",
    "pencil",
    "cloud",
    "tiger",
    "violin",
    "candle",
    "forest",
    "rocket",
    "bottle",
    "mirror",
    "planet",
    "ladder",
    "basket",
    "engine",
    "pillow",
    "island",
    "carpet",
    "dragon",
    "orange",
    "tunnel",
    "hammer",
    "jacket",
    "lemon",
    "marble",
    "needle",
    "pepper",
    "rabbit",
    "saddle",
    "tomato",
    "wallet",
    "yogurt",
    "zebra",
    "anchor",
    "café",
    "piñata",
    "naïve",
]

REVERSE = [
    "Reverse the order of these words: {words}",
    "Please write these words backwards, last one first: {words}",
    "Can you reverse this list? {words}",
]

NAMES = [
    "Ana",
    "Ben",
    "Chloé",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Zoë",
    "José",
    "Łukasz",
    "Søren",
    "Aiko",
    "Mei",
]
ACTIVITIES = [
    "read books",
    "paint walls",
    "ride a bike",
    "bake bread",
    "play chess",
    "sing songs",
    "plant flowers",
    "fix old radios",
    "write letters",
    "watch birds",
    "swim laps",
    "fly kites",
]
PLACES = [
    "park",
    "kitchen",
    "garden",
    "library",
    "harbor",
    "village",
    "garage",
    "station",
    "market",
    "forest",
    "classroom",
    "studio",
]
TIMES = ["every morning", "on Sundays", "after school", "at night", "in the summer", "each day"]
SPECIAL_SENTENCES = [
    "Zoë bought a crème brûlée in Zürich.",
    "The word for cat in Japanese is 猫.",
    "Café au lait costs 3 € today.",
    "Мы идём в парк завтра.",
    "The rocket 🚀 left at dawn.",
    "Ünal and Søren met at the fjord.",
]

REPEAT = [
    "Please repeat this sentence exactly: {sentence}",
    "Say this back to me: {sentence}",
    "Copy this sentence word for word: {sentence}",
]

OPPOSITES: dict[str, str] = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "light": "dark",
    "happy": "sad",
    "early": "late",
    "open": "closed",
    "full": "empty",
    "strong": "weak",
    "loud": "quiet",
    "high": "low",
    "wet": "dry",
    "old": "new",
    "hard": "soft",
    "rich": "poor",
    "near": "far",
    "up": "down",
    "inside": "outside",
    "first": "last",
    "win": "lose",
    "push": "pull",
    "above": "below",
    "thick": "thin",
    "sharp": "dull",
}
OPPOSITE = [
    "What is the opposite of {word}?",
    "Give me the opposite of the word {word}.",
    "Which word means the opposite of {word}?",
]

COLORS: dict[str, str] = {
    "banana": "yellow",
    "lime": "green",
    "cherry": "red",
    "blueberry": "blue",
    "plum": "purple",
    "orange": "orange",
    "coconut": "brown",
    "lemon": "yellow",
    "grape": "purple",
    "strawberry": "red",
    "kiwi": "green",
    "apricot": "orange",
}
COLOR = [
    "What color is a ripe {fruit}?",
    "Tell me the color of a {fruit}.",
    "My kid asks what color a {fruit} is. What should I say?",
]

NUMBER_WORDS = ["two", "three", "four", "five", "six"]
COUNT = [
    "How many items are in this list: {items}?",
    "Count the things in this list for me: {items}",
]

GREETING = [
    "Hello! My name is {name}.",
    "Hi there, I am {name}. Nice to meet you.",
    "Good morning! {name} here.",
]

GOALS = [
    "learn to cook",
    "run a marathon",
    "keep a clean desk",
    "learn a new language",
    "sleep better",
    "read more books",
    "grow tomatoes",
    "save for a trip",
    "learn to draw",
    "write a diary",
    "get fit at home",
    "start a small garden",
]
PLAN = [
    "Give me a simple plan to {goal}.",
    "How do I {goal}? Give me steps.",
    "I want to {goal}. Where should I start?",
]

ANIMALS = ["fox", "owl", "turtle", "cat", "dolphin", "bear", "penguin", "rabbit", "horse", "bee"]
STORY = [
    "Write a very short story about a {animal} in the {place}.",
    "Tell me a tiny story: a {animal}, the {place}.",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a patient tutor who explains things clearly.",
    "You are a friendly assistant. Keep answers short.",
    "You answer questions for curious children.",
    "Be concise and accurate.",
]

FOLLOW_UPS = ["Thanks! ", "Great. ", "Okay. ", "Nice, now another one. ", ""]
