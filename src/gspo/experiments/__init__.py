"""``gspo compare`` and its report, outside the training library (nothing in it imports them).

======================  ===========================================================
module                  what lives there
======================  ===========================================================
:mod:`.runs`            the algorithms and presets, each run's config, the shared cold
                        start, training or reusing each run, :func:`compare` itself
======================  ===========================================================
"""

from gspo.experiments.runs import ALGORITHMS as ALGORITHMS
from gspo.experiments.runs import PRESETS as PRESETS
from gspo.experiments.runs import cold_start_checkpoint as cold_start_checkpoint
from gspo.experiments.runs import compare as compare
from gspo.experiments.runs import final_eval as final_eval
from gspo.experiments.runs import run_configs as run_configs
from gspo.experiments.runs import run_or_reuse as run_or_reuse
from gspo.experiments.runs import token_weighted as token_weighted
from gspo.experiments.runs import train_lines as train_lines
from gspo.experiments.runs import with_elapsed as with_elapsed
