use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::scaler::LossScaler;
use super::{grad_stats, CpuAdam, Grad, GradStats};
use crate::chunk::{grad_ranges, ChunkKind, ChunkManager, GroupChunks, HostBlock, OverlapPlan};
use crate::error::{Error, Result};
use crate::tensor::{Stage, TensorId};
use crate::tide::Target;

/// [`HybridAdam`]: mixed-precision Adam over the chunks of a [`ChunkManager`], each chunk group
/// stepped where it is cheapest.
///
/// After backward, every parameter chunk holds its gradients (fp16/bf16, under the loss scale).
/// One step:
///
/// 1. **Statistics.** The squared norm and any infinite or NaN element of every gradient, computed
///    where each parameter chunk already is ([`ChunkManager::grad_stats`]).
/// 2. **Overflow.** An infinite or NaN gradient skips the step: the parameters the gradients
///    overwrote are restored from the fp32 masters, the loss scaler backs off, and the iteration
///    ends with [`ChunkManager::skip_step`].
/// 3. **Step.** Gradients are unscaled and clipped by the global norm through one factor folded
///    into the kernel. The first `K` chunk groups step on the device (their fp32 master,
///    momentum and variance chunks are brought there; on the simulated device this runs the same
///    CPU kernel, so placement never changes a bit); the rest step on the host with the SIMD
///    CPU Adam, which reads the fp16 gradient and writes the fp16 parameter in the same pass.
///
/// During warm-up every group steps on the host. Afterwards `K` follows the device margin, as
/// in PatrickStar, and the scheduler's trace is told where the optimizer runs
/// ([`ChunkManager::plan_optimizer`]): with `capacity` the
/// scheduler's share of the device, `margin = capacity − peak non-model − fp16 footprint`, and
/// `K = ⌊margin · fraction / (12 · chunk_elems)⌋` (12 bytes per element of fp32 master,
/// momentum and variance; 6.03 with 8-bit moments, `ManagerConfig::moments`, which the host
/// groups step with `CpuAdam::step8` and the device groups with `ops::adam8`).
///
/// **Gradient accumulation** over `N` micro-batches: after each of the first `N − 1` backward
/// passes, [`HybridAdam::step`] folds the unscaled gradients into fp32 accumulators (host
/// memory, 4 bytes per parameter element) and restores the parameters; after the `N`-th it steps
/// with the mean gradient. With accumulation every group steps on the host, where the
/// accumulators are.
///
/// **Overlap.** A host group's step does not wait for the end of backward: after each step the
/// optimizer arms the manager with the next step's scalars as they will be if nothing overflows
/// and nothing is clipped, and each host group steps on a worker thread once its gradients are
/// final and copied down, while the device goes on with backward. Where nothing can
/// invalidate the step (no loss scaler, no clip; a non-finite gradient then stops the run with
/// [`Error::NonFiniteGradients`]) each group steps in place, as it would after backward, at no
/// memory cost. Otherwise the step is SuperOffload's speculation, on copies: the originals are
/// kept until the step is decided. After backward the step's real scalars decide: if they are
/// the armed ones, every early step is kept and the group's turn in the pass costs nothing;
/// after an overflow, a clip, a changed loss scale or learning rate, each host group is stepped
/// again from its untouched originals (and the step after a clipped one is not speculated).
/// Either way the bits are those of the serial step. The
/// copies cost host memory: 12 bytes an element of master, momentum and variance (6.03 with
/// 8-bit moments: the copies hold the codes and scales) and two
/// parameter-sized buffers a group, within [`HybridConfig::overlap_budget`]. The counts and
/// bytes are [`ChunkManager::overlap_stats`]. With accumulation, each micro-batch but the
/// last folds its gradients into the accumulators during backward instead (exact, whatever
/// the step does), and the last steps after backward.
///
/// The trainer multiplies its loss by [`HybridAdam::loss_scale`] before backward.
///
/// Mixed-precision Adam over a [`ChunkManager`] (see the module docs).
///
/// ```
/// use tidemem::chunk::{ChunkManager, ManagerConfig};
/// use tidemem::device::{Device, SimConfig};
/// use tidemem::optim::{AdamConfig, HybridAdam, HybridConfig, StepOutcome};
/// use tidemem::tensor::{Init, Stage};
/// use tidemem::tide::Policy;
/// # fn main() -> tidemem::Result<()> {
/// let dev = Device::sim(SimConfig::with_capacity(1 << 20))?;
/// let mut m = ChunkManager::new(dev, ManagerConfig::new(1024, Policy::Tide))?;
/// let w = m.register("w", &[256], Init::Constant(0.5))?;
/// let mut opt = HybridAdam::new(HybridConfig::new(AdamConfig::adam(0.1)))?;
/// for _ in 0..2 {
///     m.fetch(&[w], Stage::Forward)?;
///     m.release(&[w], Stage::Forward)?;
///     m.end_forward()?;
///     m.fetch(&[w], Stage::Backward)?;
///     m.write_grad(w, &[opt.loss_scale(); 256])?; // d(loss · scale)/dw = scale
///     m.release(&[w], Stage::Backward)?;
///     m.end_backward()?;
///     assert_eq!(opt.step(&mut m)?.outcome, StepOutcome::Stepped);
/// }
/// assert!((m.master(w)?[0] - 0.3).abs() < 1e-5); // two Adam steps of lr 0.1
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct HybridAdam {
    cfg: HybridConfig,
    cpu: CpuAdam,
    scaler: Option<LossScaler>,
    steps: u64,
    micro: u32,
    acc: Arc<Accumulators>,
    touched: Vec<bool>,
    planned: Option<usize>,
    broken: bool,
    /// The last step was clipped: the next one likely is too, so it is not speculated.
    clipped_last: bool,
}

/// The counters of a [`HybridAdam`] a checkpoint holds: the step count and the loss scaler's
/// scale, clean steps and allowance.
struct Counters {
    steps: u64,
    scaler: Option<(f32, u32, u32)>,
}

/// Checkpoint metadata keys of [`HybridAdam`].
const META_STEPS: &str = "adam.steps";
const META_SCALE: &str = "loss_scaler.scale";
const META_CLEAN: &str = "loss_scaler.clean_steps";
const META_ALLOWANCE: &str = "loss_scaler.allowance";

impl HybridAdam {
    /// An optimizer with settings `cfg`.
    pub fn new(cfg: HybridConfig) -> Result<Self> {
        cfg.adam.validate()?;
        if cfg.delayed_params && cfg.accumulation_steps > 1 {
            return Err(Error::Conflict {
                what: "delayed_params".into(),
                with: "accumulation_steps > 1: the parameters are restored from the masters \
                       between micro-batches, which would end the lag (run the micro-batches \
                       in one iteration, as a pipeline stage does)"
                    .into(),
            });
        }
        if cfg.accumulation_steps == 0 {
            return Err(Error::TooFew {
                what: "accumulation_steps".into(),
                got: 0,
                need: 1,
            });
        }
        if let Some(n) = cfg.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(Error::BadValue {
                    what: "max_grad_norm".into(),
                    value: n.into(),
                    want: "finite and above 0",
                });
            }
        }
        if let DevicePlacement::Auto { fraction } = cfg.placement {
            if !(0.0..=1.0).contains(&fraction) {
                return Err(Error::BadValue {
                    what: "the device placement's fraction".into(),
                    value: fraction,
                    want: "in [0, 1]",
                });
            }
        }
        let mut cpu = CpuAdam::new();
        if cfg.threads > 0 {
            cpu = cpu.with_threads(cfg.threads);
        }
        if let Some(isa) = cfg.isa {
            cpu = cpu.with_isa(isa)?;
        }
        Ok(HybridAdam {
            cfg,
            cpu,
            scaler: cfg.loss_scale.map(LossScaler::new).transpose()?,
            steps: 0,
            micro: 0,
            acc: Arc::default(),
            touched: Vec::new(),
            planned: None,
            broken: false,
            clipped_last: false,
        })
    }

    /// The settings.
    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    /// The scale to multiply the loss by before backward.
    pub fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The loss scaler, if any.
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Optimizer steps taken (skipped steps and accumulated micro-batches do not count).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The CPU kernel in use.
    pub fn cpu(&self) -> &CpuAdam {
        &self.cpu
    }

    /// The counters a checkpoint keeps beside the chunks, as file metadata: the step count
    /// (Adam's bias correction) and the loss scaler's state. Refused in the middle of gradient
    /// accumulation, whose accumulators a checkpoint does not hold.
    pub(crate) fn checkpoint_metadata(&self) -> Result<BTreeMap<String, String>> {
        if self.micro != 0 {
            return Err(Error::Conflict {
                what: format!(
                    "a checkpoint after micro-batch {} of {}",
                    self.micro, self.cfg.accumulation_steps
                ),
                with: "gradient accumulation, whose gradients it would lose: save after the step"
                    .into(),
            });
        }
        let mut m = BTreeMap::from([(META_STEPS.to_string(), self.steps.to_string())]);
        if let Some(sc) = &self.scaler {
            // `{:?}` prints the shortest text that parses back to the same f32
            m.insert(META_SCALE.into(), format!("{:?}", sc.scale()));
            m.insert(META_CLEAN.into(), sc.clean_steps().to_string());
            m.insert(META_ALLOWANCE.into(), sc.allowance().to_string());
        }
        Ok(m)
    }

    /// Checks a checkpoint's optimizer metadata against this optimizer and returns what
    /// [`HybridAdam::restore_metadata`] applies: the step count and the scaler's state.
    fn parse_metadata(&self, meta: &BTreeMap<String, String>) -> Result<Counters> {
        fn get<T: std::str::FromStr>(meta: &BTreeMap<String, String>, key: &str) -> Result<T> {
            meta.get(key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Parse {
                    what: "a checkpoint's optimizer metadata",
                    input: format!("{key} = {:?}", meta.get(key)),
                    expected: "a value HybridAdam saved (was it saved by HybridAdam?)".into(),
                })
        }
        let steps: u64 = get(meta, META_STEPS)?;
        let scaler = match (&self.scaler, meta.contains_key(META_SCALE)) {
            (Some(_), true) => Some((
                get(meta, META_SCALE)?,
                get(meta, META_CLEAN)?,
                get(meta, META_ALLOWANCE)?,
            )),
            (None, false) => None,
            (Some(_), false) => {
                return Err(Error::Conflict {
                    what: "a checkpoint saved without loss scaling".into(),
                    with: "an optimizer that scales the loss".into(),
                })
            }
            (None, true) => {
                return Err(Error::Conflict {
                    what: "a checkpoint saved with loss scaling".into(),
                    with: "an optimizer that does not scale the loss".into(),
                })
            }
        };
        if let (Some(sc), Some((scale, clean, allowance))) = (&self.scaler, scaler) {
            // checked now, so that restoring cannot fail after the chunks were loaded
            sc.clone().restore(scale, clean, allowance)?;
        }
        // Adam's bias correction raises β to the step count as an i32
        if steps >= i32::MAX as u64 {
            return Err(Error::TooLarge {
                what: "the checkpoint's adam.steps (the step counts Adam's bias correction \
                       takes)"
                    .into(),
                requested: steps.into(),
                limit: i32::MAX as u64 - 1,
            });
        }
        Ok(Counters { steps, scaler })
    }

    /// The step count a checkpoint's metadata holds.
    pub(crate) fn checkpoint_steps(&self, meta: &BTreeMap<String, String>) -> Result<u64> {
        self.parse_metadata(meta).map(|c| c.steps)
    }

    /// Checks that a checkpoint's metadata fits this optimizer, changing nothing.
    pub(crate) fn check_metadata(&self, meta: &BTreeMap<String, String>) -> Result<()> {
        self.parse_metadata(meta).map(drop)
    }

    /// Restores the counters of [`HybridAdam::checkpoint_metadata`]; fails, changing nothing,
    /// on metadata that does not fit this optimizer.
    pub(crate) fn restore_metadata(&mut self, meta: &BTreeMap<String, String>) -> Result<()> {
        let Counters { steps, scaler } = self.parse_metadata(meta)?;
        if let (Some(sc), Some((scale, clean, allowance))) = (&mut self.scaler, scaler) {
            sc.restore(scale, clean, allowance)?;
        }
        self.steps = steps;
        self.micro = 0;
        self.acc = Arc::default();
        self.touched.clear();
        // a load is the way back after a failed step, and may come with a new manager whose
        // trace does not know the device placement yet
        self.broken = false;
        self.planned = None;
        Ok(())
    }

    /// Saves `m`'s chunks ([`ChunkManager::save_checkpoint`]) with this optimizer's step count
    /// and loss scaler state in the file's metadata. Between iterations only, and not in the
    /// middle of gradient accumulation.
    pub fn save_checkpoint(&self, m: &mut ChunkManager, path: impl AsRef<Path>) -> Result<()> {
        m.save_checkpoint(path, &self.checkpoint_metadata()?)
    }

    /// Loads a checkpoint of [`HybridAdam::save_checkpoint`] into `m` and this optimizer, so
    /// that training goes on exactly as it would have from the save. Everything is checked
    /// before anything changes (the chunks, and the optimizer's metadata: loss scaling on both
    /// sides or neither).
    pub fn load_checkpoint(&mut self, m: &mut ChunkManager, path: impl AsRef<Path>) -> Result<()> {
        m.check_idle("load_checkpoint", false)?;
        let file = crate::checkpoint::Reader::open(path.as_ref())?;
        let meta = m.load_checkpoint_file(&file, |meta| self.check_metadata(meta))?;
        self.restore_metadata(&meta)?;
        // the next step is armed by the step after it
        m.arm_overlap(None);
        Ok(())
    }

    /// How many chunk groups of `m` step on the device now: none during warm-up (the device
    /// budget is not known yet) or with accumulation, else as the placement says.
    pub fn device_groups(&self, m: &ChunkManager) -> usize {
        if self.cfg.accumulation_steps > 1 || !m.is_steady() {
            return 0;
        }
        self.cfg.placement.groups(
            &m.config().scheduler,
            m.non_model_peak(),
            m.param_footprint(),
            &m.layout().group_elems,
            m.config().moments,
        )
    }

    /// Runs the optimizer for the iteration whose backward just ended (after
    /// [`ChunkManager::end_backward`]) and ends it with [`ChunkManager::end_step`] (or
    /// [`ChunkManager::skip_step`] on an overflow).
    ///
    /// An error before any group was touched (e.g. outside the optimizer stage) changes nothing.
    /// An error partway through a pass (a device or budget failure on a later group) leaves
    /// earlier groups stepped and later ones not; the optimizer then refuses further steps, since
    /// stepping again would treat updated parameters as gradients: restore from a checkpoint.
    ///
    /// Trainers call it through the store, `m.step(&mut adam)`
    /// ([`ParamStore::step`](crate::store::ParamStore::step)), the same way on every store.
    pub fn step(&mut self, m: &mut ChunkManager) -> Result<StepReport> {
        self.step_reducing(m, &mut Ok)
    }

    /// Like [`HybridAdam::step`], with the gradient statistics of this process's chunks passed
    /// through `reduce` before they decide anything: data-parallel ranks that each hold a shard
    /// all-reduce them (sum of squares summed, the overflow flag by MAX), so every rank skips
    /// together and clips by the global norm. `ZeroManager::step` (in `zero`) does this.
    pub(crate) fn step_reducing(
        &mut self,
        m: &mut ChunkManager,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        if self.broken {
            return Err(Error::Poisoned {
                what: "optimizer",
                reason: "a previous step failed partway; the chunk groups are out of step".into(),
            });
        }
        if m.stage() != Some(Stage::Optimizer) {
            return Err(Error::OutOfOrder {
                call: "HybridAdam::step",
                needs: "end_backward",
            });
        }
        let r = self.step_inner(m, reduce);
        if r.is_err() {
            self.broken = true;
            // no step runs early (in place, perhaps) for an optimizer that refuses to step
            m.arm_overlap(None);
        }
        r
    }

    fn step_inner(
        &mut self,
        m: &mut ChunkManager,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        let scale = self.loss_scale();
        if self.cfg.accumulation_steps > 1 {
            return self.step_accumulated(m, scale, reduce);
        }
        let k = self.device_groups(m);
        let place = move |g: usize| if g < k { Target::Device } else { Target::Host };
        if m.is_steady() && self.planned != Some(k) {
            m.plan_optimizer(place);
            self.planned = Some(k);
        }
        let st = reduce(m.grad_stats()?)?;
        if st.nonfinite {
            let in_place = m.overlap_verdict(None)?;
            restore(m, place)?;
            if self.scaler.is_none() {
                m.skip_step()?;
                return Err(Error::NonFiniteGradients {
                    step: self.steps + 1,
                    in_place,
                });
            }
            return self.skip(m, scale, k, st);
        }
        let norm = st.sum_sq.sqrt() / scale as f64;
        let clip = self.clip_coef(norm);
        let s = self.cfg.adam.scalars(self.steps + 1, clip / scale)?;
        m.overlap_verdict(Some(&overlap_key(&s, k, self.in_place(m))))?;
        if self.cfg.overlap && !self.cfg.delayed_params && m.is_steady() {
            // host groups not stepped during backward step on the worker, in the next
            // forward's order, each waited for by that forward's first use of the group
            let (cpu, dt) = (self.cpu.with_threads(1), m.param_dtype());
            let step = Arc::new(move |b: HostBlock<'_>| step_block(&cpu, &s, dt, b));
            m.defer_host_steps(step, self.cpu.threads());
        }
        let (cpu, delayed) = (self.cpu, self.cfg.delayed_params);
        let dev = m.device().clone();
        m.visit_groups(&ChunkKind::ALL, place, |v| {
            let _span = host_span(&dev, &v);
            adam_group(&cpu, &s, v, None, delayed)
        })?;
        self.finish(m, scale, k, norm, clip)
    }

    /// Arms `m` to step its host groups during the next backward with the scalars the next
    /// step takes if nothing overflows and nothing is clipped (see "Overlap" in the module
    /// docs), or disarms it where overlap does not apply.
    fn arm(&self, m: &mut ChunkManager) -> Result<()> {
        let n = self.cfg.accumulation_steps;
        if self.cfg.overlap && n > 1 && m.is_steady() && self.micro + 1 < n {
            return self.arm_fold(m);
        }
        let k = self.device_groups(m);
        // a step the last one's clip predicts will clip again is not speculated: its early
        // steps would be thrown away, their CPU work done twice
        let applies = self.cfg.overlap
            && n == 1
            && !self.cfg.delayed_params
            && m.is_steady()
            && k < m.groups()
            && !self.clipped_last;
        if !applies {
            m.arm_overlap(None);
            return Ok(());
        }
        let s = self
            .cfg
            .adam
            .scalars(self.steps + 1, 1.0 / self.loss_scale())?;
        let (cpu, dt) = (self.cpu.with_threads(1), m.param_dtype());
        let in_place = self.in_place(m);
        let tail = k.saturating_add(self.cfg.overlap_tail).min(m.groups());
        m.arm_overlap(Some(OverlapPlan {
            first_host: if in_place {
                tail
            } else {
                self.first_shadowed(m, k).max(tail)
            },
            in_place,
            threads: self.cpu.threads(),
            key: overlap_key(&s, k, in_place),
            step: Arc::new(move |b: HostBlock<'_>| step_block(&cpu, &s, dt, b)),
            fold: false,
        }));
        Ok(())
    }

    /// Whether nothing can invalidate a step (no loss scaler, no clip, no copy of optimizer
    /// state between backward and the step), so that host groups step in place during
    /// backward.
    fn in_place(&self, m: &ChunkManager) -> bool {
        self.scaler.is_none() && self.cfg.max_grad_norm.is_none() && m.in_place_allowed()
    }

    /// The first of the host groups `k..` of `m` whose shadows fit the overlap's budget.
    fn first_shadowed(&self, m: &ChunkManager, k: usize) -> usize {
        let elems = &m.layout().group_elems;
        let es = m.param_dtype().size();
        let moments = m.config().moments;
        let model_data: u64 = elems
            .iter()
            .map(|&e| (e * (es + 4)) as u64 + 2 * moments.bytes(e))
            .sum();
        let budget = self
            .cfg
            .overlap_budget
            .bytes(crate::limits::host_memory(), model_data);
        ShadowBudget::first_early(budget, k, elems, es, moments)
    }

    /// Arms `m` to fold the next (not last) micro-batch's gradients into the accumulators
    /// during its backward.
    fn arm_fold(&self, m: &mut ChunkManager) -> Result<()> {
        let acc = if self.acc.acc.len() == m.groups() {
            Arc::clone(&self.acc)
        } else {
            // sized before the first fold; the accumulators are made when the first
            // micro-batch is folded after backward
            m.arm_overlap(None);
            return Ok(());
        };
        let inv = 1.0 / self.loss_scale();
        let dt = m.param_dtype();
        m.arm_overlap(Some(OverlapPlan {
            first_host: 0,
            in_place: false,
            threads: self.cpu.threads(),
            key: fold_key(self.micro, inv, &acc),
            step: Arc::new(move |b: HostBlock<'_>| fold_block(&acc, inv, dt, b)),
            fold: true,
        }));
        Ok(())
    }

    fn clip_coef(&self, norm: f64) -> f32 {
        match self.cfg.max_grad_norm {
            Some(max) if norm > max as f64 => (max as f64 / (norm + 1e-6)) as f32,
            _ => 1.0,
        }
    }

    fn finish(
        &mut self,
        m: &mut ChunkManager,
        scale: f32,
        k: usize,
        norm: f64,
        clip: f32,
    ) -> Result<StepReport> {
        self.steps += 1;
        let scale_update = self.scaler.as_mut().map(|s| s.update(false));
        self.clipped_last = clip < 1.0;
        m.end_step()?;
        self.arm(m)?;
        Ok(StepReport {
            outcome: StepOutcome::Stepped,
            steps: self.steps,
            loss_scale: scale,
            grad_norm: norm,
            clip_coef: clip,
            device_groups: k,
            scale_update,
        })
    }

    fn skip(
        &mut self,
        m: &mut ChunkManager,
        scale: f32,
        k: usize,
        st: GradStats,
    ) -> Result<StepReport> {
        let scale_update = self.scaler.as_mut().map(|s| s.update(true));
        m.skip_step()?;
        self.arm(m)?;
        Ok(StepReport {
            outcome: StepOutcome::Skipped,
            steps: self.steps,
            loss_scale: scale,
            grad_norm: if st.sum_sq.is_finite() {
                f64::INFINITY
            } else {
                st.sum_sq
            },
            clip_coef: 1.0,
            device_groups: k,
            scale_update,
        })
    }

    fn step_accumulated(
        &mut self,
        m: &mut ChunkManager,
        scale: f32,
        reduce: &mut dyn FnMut(GradStats) -> Result<GradStats>,
    ) -> Result<StepReport> {
        let n = self.cfg.accumulation_steps;
        let groups = m.groups();
        if self.acc.acc.len() != groups {
            self.acc = Arc::new(Accumulators::new(&m.layout().group_elems));
        }
        // an intermediate micro-batch's fold may have run during backward, into these
        // accumulators' pending ones (the key names them: a plan armed by another optimizer,
        // or before a checkpoint was loaded, is not this fold)
        let fold = self.micro + 1 < n;
        let key = fold.then(|| fold_key(self.micro, 1.0 / scale, &self.acc));
        // (a fold is armed for micro-batches but the last: the last is never abandoned in place)
        m.overlap_verdict(key.as_deref())?;
        self.touched.resize(m.num_tensors(), false);
        let inv = 1.0 / scale;
        let (acc, touched) = (&self.acc, &mut self.touched);
        // fold the gradients into the accumulators and give the parameters back their values
        m.visit_groups(
            &[ChunkKind::Param, ChunkKind::Master],
            |_| Target::Host,
            |v| {
                let GroupChunks::Host {
                    param,
                    master: Some(master),
                    ..
                } = v.chunks
                else {
                    unreachable!("a host visit of the parameter and master chunks")
                };
                let es = v.param_dtype.size();
                let mut a = acc.acc[v.group].write();
                a.resize(param.len() / es, 0.0);
                for &(id, _, _, has) in &v.tensors {
                    touched[id.index()] |= has;
                }
                let mut g = Vec::new();
                for r in &v.ranges {
                    g.resize(r.len(), 0.0f32);
                    let bytes = &mut param[r.start * es..r.end * es];
                    to_f32(bytes, v.param_dtype, &mut g)?;
                    for (x, &y) in a[r.clone()].iter_mut().zip(&g) {
                        *x += y * inv;
                    }
                    from_f32(&master[r.clone()], bytes, v.param_dtype)?;
                }
                Ok(())
            },
        )?;
        // the groups folded during backward: their pending accumulators are the new ones
        for g in 0..groups {
            if m.stepped_early(g) {
                std::mem::swap(&mut *acc.acc[g].write(), &mut *acc.pending[g].lock());
                for (id, has) in m.group_grad_flags(g) {
                    touched[id.index()] |= has;
                }
            }
        }
        self.micro += 1;
        if self.micro < n {
            m.end_step()?;
            self.arm(m)?;
            return Ok(StepReport {
                outcome: StepOutcome::Accumulated,
                steps: self.steps,
                loss_scale: scale,
                grad_norm: 0.0,
                clip_coef: 1.0,
                device_groups: 0,
                scale_update: None,
            });
        }
        self.micro = 0;
        let mut local = GradStats::default();
        for (g, a) in self.acc.acc.iter().enumerate() {
            let a = a.read();
            local = local.merge(grad_stats(Grad::F32(&a)));
            // tensors counted in part (replicated over a tensor-parallel group)
            for (r, share) in m.partial_shares(g, false) {
                let part = grad_stats(Grad::F32(a.get(r).unwrap_or(&[])));
                local = local.merge(GradStats {
                    sum_sq: part.sum_sq * (share - 1.0),
                    nonfinite: part.nonfinite,
                });
            }
        }
        let st = reduce(local)?;
        if st.nonfinite {
            self.clear_accumulators();
            if self.scaler.is_none() {
                m.skip_step()?;
                return Err(Error::NonFiniteGradients {
                    step: self.steps + 1,
                    in_place: false,
                });
            }
            return self.skip(m, scale, 0, st);
        }
        let norm = st.sum_sq.sqrt() / n as f64;
        let clip = self.clip_coef(norm);
        let s = self.cfg.adam.scalars(self.steps + 1, clip / n as f32)?;
        let (cpu, acc, touched) = (self.cpu, &self.acc, &self.touched);
        let delayed = self.cfg.delayed_params;
        let dev = m.device().clone();
        m.visit_groups(
            &ChunkKind::ALL,
            |_| Target::Host,
            |mut v| {
                let _span = host_span(&dev, &v);
                let flagged: Vec<(TensorId, usize, usize, bool)> = v
                    .tensors
                    .iter()
                    .map(|&(id, off, len, _)| (id, off, len, touched[id.index()]))
                    .collect();
                v.ranges = grad_ranges(&flagged);
                let a = acc.acc[v.group].read();
                adam_group(&cpu, &s, v, Some(&a), delayed)
            },
        )?;
        self.clear_accumulators();
        self.finish(m, scale, 0, norm, clip)
    }

    fn clear_accumulators(&mut self) {
        self.acc.acc.iter().for_each(|a| a.write().fill(0.0));
        self.touched.fill(false);
    }
}

mod config;
mod steps;

pub use config::{DevicePlacement, HybridConfig, ShadowBudget, StepOutcome, StepReport};

use steps::{
    adam_group, fold_block, fold_key, from_f32, host_span, overlap_key, restore, step_block,
    to_f32, Accumulators,
};
