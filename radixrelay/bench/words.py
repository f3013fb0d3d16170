"""The vocabulary workload prompts are drawn from: 512 common English words, each one token with its
leading space in SmolLM2's vocabulary (a test checks it) and in most byte-level BPE vocabularies, so a
text of n words is about n tokens."""

WORDS: tuple[str, ...] = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from or had
by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live where after back
little only round man year came show every good me give our under name very through just form great
think say help low line turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer
school grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second book carry
took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird soon
body dog family direct leave song measure door product black short class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground interest
reach fast sing listen six table travel less morning ten simple several vowel toward lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
energy probable bed brother egg ride cell believe perhaps pick sudden count square reason length
represent art subject region size vary settle speak weight general ice matter circle pair include
divide syllable felt grand ball yet wave drop heart present heavy dance engine position arm wide
sail material fraction forest sit race window store summer train sleep prove leg exercise wall catch
wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower strange gone trade melody
trip office receive row mouth exact symbol least trouble shout except wrote seed tone join suggest
clean break lady yard rise bad blow oil touch grew
""".split())
