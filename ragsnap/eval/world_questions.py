"""Common-knowledge questions for the world-knowledge check (issue 53): capitals,
inventors, authors, dates and science facts a small model may answer from memory.

Each entry is ``(question, answers)``; ``answers`` are the strings a right answer
contains (any of them). ``ragsnap.eval.world_knowledge`` asks each over documents that
do not hold its answer, so a grounded verdict there is wrong whatever the answer says.
"""

from __future__ import annotations

WORLD_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # capitals
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is the capital of Australia?", ("Canberra",)),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Argentina?", ("Buenos Aires",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("Which city is the capital of Portugal?", ("Lisbon",)),
    ("Which city is the capital of Greece?", ("Athens",)),
    # inventors and discoverers
    ("Who invented the telephone?", ("Bell",)),
    ("Who invented the light bulb?", ("Edison",)),
    ("Who discovered penicillin?", ("Fleming",)),
    ("Who developed the theory of relativity?", ("Einstein",)),
    ("Who formulated the laws of motion and universal gravitation?", ("Newton",)),
    ("Who invented the printing press?", ("Gutenberg",)),
    ("Who discovered radium and polonium?", ("Curie",)),
    ("Who proposed the theory of evolution by natural selection?", ("Darwin",)),
    ("Who invented the World Wide Web?", ("Berners-Lee", "Berners Lee")),
    ("Who developed the first polio vaccine?", ("Salk",)),
    ("Who invented dynamite?", ("Nobel",)),
    ("Who built the first airplane to fly successfully?", ("Wright",)),
    ("Who discovered the circulation of blood?", ("Harvey",)),
    # authors and artists
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Who wrote Pride and Prejudice?", ("Austen",)),
    ("Who wrote the novel 1984?", ("Orwell",)),
    ("Who wrote War and Peace?", ("Tolstoy",)),
    ("Who wrote Don Quixote?", ("Cervantes",)),
    ("Who wrote The Origin of Species?", ("Darwin",)),
    ("Who painted the Mona Lisa?", ("Leonardo", "Vinci")),
    ("Who composed the Fifth Symphony that begins with four famous notes?", ("Beethoven",)),
    ("Who wrote the Odyssey?", ("Homer",)),
    ("Who wrote Moby-Dick?", ("Melville",)),
    ("Who wrote the Divine Comedy?", ("Dante",)),
    # dates
    ("In what year did World War II end?", ("1945",)),
    ("In what year did the Titanic sink?", ("1912",)),
    ("In what year did humans first land on the Moon?", ("1969",)),
    ("In what year did Christopher Columbus first reach the Americas?", ("1492",)),
    ("In what year did the Berlin Wall fall?", ("1989",)),
    ("In what year was the United States Declaration of Independence signed?", ("1776",)),
    ("In what year did World War I begin?", ("1914",)),
    ("In what year did the French Revolution begin?", ("1789",)),
    ("When was the Magna Carta sealed?", ("1215",)),
    ("In what year did the Soviet Union dissolve?", ("1991",)),
    # science facts
    ("What is the chemical symbol for gold?", ("Au",)),
    ("What is the boiling point of water at sea level in degrees Celsius?", ("100",)),
    ("How many planets are in the Solar System?", ("eight", "8")),
    ("What is the largest planet in the Solar System?", ("Jupiter",)),
    ("What gas do plants absorb from the air for photosynthesis?", ("carbon dioxide", "CO2")),
    ("What is the hardest natural substance?", ("diamond",)),
    ("What is the chemical formula of water?", ("H2O",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("How many bones are in the adult human body?", ("206",)),
    ("What is the speed of light in a vacuum in kilometres per second?", ("300,000", "299,792")),
    ("What is the atomic number of carbon?", ("6", "six")),
    ("Which organ pumps blood through the human body?", ("heart",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the tallest mountain on Earth?", ("Everest",)),
    ("What is the longest river in Africa?", ("Nile",)),
    ("Which element has the chemical symbol Fe?", ("iron",)),
)
