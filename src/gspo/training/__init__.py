"""The rooms of the RL loop that :mod:`gspo.trainer` composes.

One rollout batch flows through them in this order::

    prompts --RolloutStage--> Experience --UpdateStage (per minibatch)--> metrics
       (sample, score, advantages,       (log-probs -> loss -> optimizer step)
        old and reference log-probs)

============================  =========================================================
module                        what lives there
============================  =========================================================
:mod:`.seeds`                 derived seeds: every draw a function of ``train.seed``
:mod:`.setup`                 task data, the model, the optimizer
:mod:`.reward_columns`        the rows' reward columns checked before a run starts
:mod:`.policy`                :class:`Policy`: the trained weights behind one handle; how
                              minibatch log-probs are computed (plain, MoE routing)
:mod:`.sampler`               the rollout engine, kept in step with the policy
:mod:`.rollout`               prompts -> rollout -> scores -> advantages -> pi_old,
                              reference; the loss mask
:mod:`.update`                the :class:`Experience` and its minibatches; the objective
                              and one optimizer step per minibatch
:mod:`.hooks`                 optional instruments: expert churn, ratio dumps, mismatch
:mod:`.reference`             the frozen KL reference
:mod:`.cold_start`            supervised fine-tuning before RL
:mod:`.evaluation`            held-out accuracy
:mod:`.checkpoint`            naming, writing and finding checkpoints
:mod:`.metrics`               timers and how each metric combines across ranks
============================  =========================================================
"""
