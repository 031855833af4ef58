"""DHO2 and MR-DHO2, distributed FOSI (Gu et al., secs. III and IV): what they compute, hold and send.

Both compose FOSI's public pieces (:mod:`tritonopt.optim.functional`,
:mod:`tritonopt.optim.lanczos`, :class:`~tritonopt.optim.fosi.FOSIConfig`) with
their collectives. This module describes both and holds their public names; the
code lives in :mod:`~tritonopt.dist.dho2_data_parallel` (DHO2) and
:mod:`~tritonopt.dist.dho2_multirole` (MR-DHO2).

DHO2 (:class:`DHO2`) -- data parallel, every rank runs the same update. It is
:class:`~tritonopt.optim.FOSI` with a :class:`ShardedSubspace`:

* gradient: ``all_reduce`` of the flat gradient, divided by ``C`` ("grad_all_reduce", n);
* ESE: Algorithm 2 (:func:`tritonopt.dist.lanczos.distributed_lanczos`; ``D`` row
  shard ``[m, ceil(n/C)]`` per rank), ``eigh(B)`` on every rank, then one
  ``all_to_all`` turns the Ritz-vector row shard into ``r_c`` whole vectors
  (``V_c``: ``[r_c, n]``, rows ``[start_c, start_c + r_c)`` of ``V``); with
  ``g1_momentum``, one more ``all_reduce`` ("velocity_all_reduce", n) carries
  the velocity into the new basis;
* update, ``variant="algorithm3"`` (Algorithm 3 as printed, 4 n-sized all_reduces
  per step)::

      g  = AR(grad) / C;  g1 = AR(V_c^T V_c g);  d1 = AR(-rho V_c^T (s_c * q_c))
      u  = O(g - g1);     w += d1 + b (u - AR(V_c^T V_c u))

  with ``q_c = V_c g1`` or its velocity, ``rho`` the groups' Newton factors
  (``lr / initial_lr``), ``b`` the base-step scale. ``variant="fused"``
  (default, 3 all_reduces: "grad_all_reduce", "g1_all_reduce",
  "update_all_reduce"): the Newton term and the projection share one
  all_reduce: ``w += b u + AR(-rho V_c^T (s_c * q_c) - b V_c^T V_c u)``.

Each rank holds the model, the gradient, the base optimizer's state
(replicated, as in the paper), ``V_c`` (``r_c n``) and, during the ESE only,
its ``D`` shard. Checkpoints are per rank: :meth:`DHO2.load_state_dict` issues
one one-integer all_reduce ("load_state_dict") and refuses, on every rank, a
state dict saved on another rank once curvature exists.

MR-DHO2 (:class:`MRDHO2`) -- ranks ``0..A-1`` are accelerators, ``A..C-1`` workers.
Per epoch (the caller brackets each epoch with :meth:`MRDHO2.begin_epoch` /
:meth:`MRDHO2.end_epoch`; workers call :meth:`MRDHO2.step` after each backward):

* begin: ``broadcast`` of the weights ``c`` from the first worker to the
  accelerators ("weights_broadcast", group accelerators + first worker, n);
  accelerators run Algorithm 2 among themselves on ``curvature_loss_fn`` at ``c``;
* every worker step: ``all_reduce`` of the gradient among workers, divided by
  ``J`` ("worker_grad_all_reduce", n); ``w += O(g)``; ``p += g`` (eq. 13);
* end: one world ``all_to_all`` ("ritz_scatter") sends each worker ``j`` its
  ``r_j`` Ritz vectors (every accelerator sends its rows ``[n/A]`` of them),
  two ``broadcast`` from rank 0 of the count and of the Ritz values with the
  spectrum's scale ("eigenvalue_broadcast"), and the final model update
  (eq. 17) on the workers with 2 all_reduces among workers
  ("final_newton_and_projection" (2n), "final_reprojection" (n))::

      o = w - c;   w_new = c - sum_j V_j^T (s_j * V_j p~) + (I - P)(I - P) o

  ``p~ = p`` (``accumulated_gradient="sum"``, default, eq. 15 as printed) or
  ``p / I`` (``"mean"``). FOSI applies one Newton step per iteration, so over
  an epoch of ``I`` steps it moves by the Newton step of the summed gradients:
  the sum keeps alpha on the same scale as FOSI's; the mean applies a single
  step's worth and is the more cautious option.

Accelerators do not train; their weights follow the broadcast at each epoch start.

Both layers take a ``timeout`` that applies to every process group they
create (DHO2 creates one only when given a timeout), check at construction,
with two small ``all_gather`` of 8-byte digests ("config_check"), that every
rank has the same model shapes, hyperparameters and world layout (else every
rank raises ``ValueError`` naming the settings that differ and each rank's
value; a rank that refused its own arguments joins that check with its error,
so every rank raises at once, the others naming it), and re-raise a
failed collective (a rank that died, or stalled past the timeout) as
:class:`~tritonopt.dist._collective_guard.CollectiveFailure` naming the
collective and the ranks.
"""

from tritonopt.dist.dho2_data_parallel import DHO2, ShardedSubspace
# Eq. (17)'s functions stay importable from here, beside the layers.
from tritonopt.dist.dho2_multirole import MRDHO2, final_update_local, final_update_reference  # noqa: F401

__all__ = ["DHO2", "MRDHO2", "ShardedSubspace"]
