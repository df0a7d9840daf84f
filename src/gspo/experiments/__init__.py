"""``gspo compare`` and its report, outside the training library (nothing in it imports them).

Layers never import upward: ``summary`` <- ``claims`` <- ``report`` <- ``runs``
(``trained_on`` beside them, for ``runs``).

======================  ===========================================================
module                  what lives there
======================  ===========================================================
:mod:`.runs`            the algorithms and presets, each run's config, the shared cold
                        start, training or reusing each run, :func:`compare` itself
:mod:`.summary`         numbers from finished runs: records, ratio dumps, gradient
                        cosines, one summary per algorithm over its seeds
:mod:`.claims`          the paper's claims: a verdict per claim, the computed notes
:mod:`.report`          plots, report.md, report.html and summary.json
:mod:`.trained_on`      the commit and machine each run was trained on
======================  ===========================================================
"""

from gspo.experiments.runs import ALGORITHMS as ALGORITHMS
from gspo.experiments.runs import PRESETS as PRESETS
from gspo.experiments.runs import cold_start_checkpoint as cold_start_checkpoint
from gspo.experiments.runs import compare as compare
from gspo.experiments.runs import run_configs as run_configs
from gspo.experiments.runs import run_or_reuse as run_or_reuse
from gspo.experiments.summary import final_eval as final_eval
from gspo.experiments.summary import token_weighted as token_weighted
from gspo.experiments.summary import train_lines as train_lines
from gspo.experiments.summary import with_elapsed as with_elapsed
