# ruff: noqa: E501 (prose lines are kept whole)
"""The small text the synthetic PLaMo tokenizers learn their pieces from (written for this project).

English word problems and prose, Japanese prose, numbers and a little code-like punctuation: enough
for a realistic mix of word pieces, leading-space pieces, digits and kana/kanji pieces.
"""

ENGLISH = """\
Question: Mia buys 3 boxes of pencils. Each box holds 12 pencils and costs $4. How many pencils does she have, and how much did she pay?
Answer: She has 3 * 12 = 36 pencils. She paid 3 * 4 = $12 for them.
#### 36
Question: A train leaves the station at 8:15 in the morning and arrives at 11:45. How long is the trip in minutes?
Answer: From 8:15 to 11:15 is 3 hours, which is 180 minutes. Then 30 more minutes makes 210 minutes in total.
#### 210
Question: Tom had 250 stamps. He gave 75 to his sister and bought 40 more at the market. How many stamps does Tom have now?
Answer: After giving some away he had 250 - 75 = 175 stamps. Then he had 175 + 40 = 215 stamps.
#### 215
Question: The bakery sold 48 muffins in the morning and half as many in the afternoon. Each muffin costs $2.50. How much money did the bakery make?
Answer: In the afternoon it sold 48 / 2 = 24 muffins, so 48 + 24 = 72 muffins in all. That is 72 * 2.50 = $180.
#### 180
Question: A farmer plants 6 rows of trees with 15 trees in each row. A storm knocks down 9 of the trees. How many trees are still standing?
Answer: He planted 6 * 15 = 90 trees, and 90 - 9 = 81 of them are still standing.
#### 81
Question: Sara reads 20 pages every day. Her book has 340 pages and she has already read 100 of them. How many more days will she need?
Answer: She still has 340 - 100 = 240 pages to read, which takes 240 / 20 = 12 days.
#### 12
Question: There are 5 classes in the school and every class has 28 students. If 17 students are absent today, how many students are present?
Answer: The school has 5 * 28 = 140 students, so 140 - 17 = 123 students are present.
#### 123
Question: James saves $15 each week. How many weeks does it take him to save enough for a bike that costs $225?
Answer: It takes him 225 / 15 = 15 weeks.
#### 15
The weather was warm and bright, so the children decided to walk to the river after lunch.
They carried a basket of apples, two bottles of water and an old map that their grandfather had drawn years ago.
Along the way they counted birds, measured the shadows of the tallest trees and argued about the fastest path.
When they finally reached the water, the sun was already lower in the sky and the air smelled of grass and rain.
Every number in the notebook was checked twice: first by adding the columns, then by subtracting the totals.
The difference between the two results was zero, which meant that the calculation was correct.
In the evening the family shared dinner, talked about the week and planned a small trip for the weekend.
Learning something new takes time, patience and practice, but the feeling of understanding is worth the effort.
A model reads text as a sequence of tokens, and a good tokenizer keeps frequent words whole while splitting rare ones.
The price of the ticket increased by 20 percent, from $45 to $54, because the theater added more seats.
If x = 7 and y = 3, then x + y = 10, x - y = 4, x * y = 21 and x / y is about 2.33.
print("hello, world")  # a comment, with (parentheses), [brackets] and {braces}
def total(values): return sum(values) / len(values) if values else 0.0
"""

JAPANESE = """\
東京から大阪までは新幹線で約二時間半かかります。
今日は朝から雨が降っていたので、私たちは家で本を読んだり映画を見たりしました。
この問題を解くためには、まず全体の数を求めてから、それぞれの割合を計算します。
りんごが三つとみかんが五つあります。あわせていくつありますか。
答えは八つです。
日本語の文章には、ひらがな、カタカナ、漢字、そして数字や記号が混ざっています。
大規模言語モデルは、大量のテキストから次の単語を予測するように学習されます。
トークナイザは文字列をトークンの列に変換し、モデルはそのトークンを一つずつ処理します。
駅の近くに新しい図書館ができたので、週末には多くの人が訪れています。
先生は生徒に、計算の途中の式も必ず書くように言いました。
彼女は毎朝六時に起きて、公園を三十分ほど散歩してから仕事に出かけます。
価格が千二百円から千五百円に上がったので、差額は三百円です。
この町には古い寺と美しい庭があり、春になると桜を見に観光客が集まります。
"""

TEXT = ENGLISH + JAPANESE
