// The bindings' shared scenario, in Go: a CPU engine, two sequences, a
// synthetic context appended in chunks, decoding steps for both sequences in
// one batch compared with exact attention computed here (float64), the
// stats, a sequence saved to a file and loaded back (decoding it bit for bit
// as the original, a corrupted copy and an engine of another head_dim
// refused), and three errors (a bad shape, an unknown layer, use after
// close) with their status and message.
package wavekv_test

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"wavekv"
)

const (
	nLayers = 2
	nQ      = 4
	nKV     = 2
	dim     = 64
	topics  = 8
	chunk   = 700 // prompt chunks cut across segment boundaries
	steps   = 4
)

// rng is SplitMix64 with Box-Muller normals: the same numbers everywhere.
type rng struct{ s uint64 }

func (r *rng) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	z := r.s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (r *rng) uniform() float64 { return (float64(r.next()>>11) + 0.5) / float64(uint64(1)<<53) }

func (r *rng) normal() float64 {
	u, v := r.uniform(), r.uniform()
	return math.Sqrt(-2*math.Log(u)) * math.Cos(2*math.Pi*v)
}

func (r *rng) below(n int) int { return int(r.next() % uint64(n)) }

// model makes keys of realistic structure: per KV head a shared offset, a
// few topics, and noise; values are noise; queries lean towards one topic.
type model struct {
	offset []float64 // [nKV][dim]
	topics []float64 // [nKV][topics][dim]
}

func newModel(r *rng) *model {
	m := &model{offset: make([]float64, nKV*dim), topics: make([]float64, nKV*topics*dim)}
	for i := range m.offset {
		m.offset[i] = 2 * r.normal()
	}
	for i := range m.topics {
		m.topics[i] = r.normal()
	}
	return m
}

// token appends one token's k and v, [nKV][dim] each.
func (m *model) token(r *rng, k, v []float32) ([]float32, []float32) {
	for g := 0; g < nKV; g++ {
		z := r.below(topics)
		for i := 0; i < dim; i++ {
			x := m.offset[g*dim+i] + m.topics[(g*topics+z)*dim+i] + 0.5*r.normal()
			k = append(k, float32(x))
			v = append(v, float32(r.normal()))
		}
	}
	return k, v
}

// query appends one sequence's queries, [nQ][dim].
func (m *model) query(r *rng, q []float32) []float32 {
	for h := 0; h < nQ; h++ {
		g := h / (nQ / nKV)
		z := r.below(topics)
		for i := 0; i < dim; i++ {
			q = append(q, float32(0.5*m.topics[(g*topics+z)*dim+i]+0.3*r.normal()))
		}
	}
	return q
}

// exactAttention appends the attention of one sequence's queries over all
// its tokens of a layer ([nQ][dim]) to out, and the log-sum-exps of the
// scaled scores ([nQ]) to lse, computed in float64.
func exactAttention(q, k, v []float32, out, lse []float64) ([]float64, []float64) {
	n := len(k) / (nKV * dim)
	scale := 1 / math.Sqrt(dim)
	scores := make([]float64, n)
	for h := 0; h < nQ; h++ {
		g := h / (nQ / nKV)
		qh := q[h*dim : (h+1)*dim]
		max := math.Inf(-1)
		for t := range scores {
			kt := k[(t*nKV+g)*dim : (t*nKV+g+1)*dim]
			s := 0.0
			for i := range qh {
				s += float64(qh[i]) * float64(kt[i])
			}
			scores[t] = s * scale
			max = math.Max(max, scores[t])
		}
		sum := 0.0
		acc := make([]float64, dim)
		for t, s := range scores {
			w := math.Exp(s - max)
			sum += w
			vt := v[(t*nKV+g)*dim : (t*nKV+g+1)*dim]
			for i := range acc {
				acc[i] += w * float64(vt[i])
			}
		}
		for i := range acc {
			out = append(out, acc[i]/sum)
		}
		lse = append(lse, max+math.Log(sum))
	}
	return out, lse
}

func relL2(got []float32, want []float64) float64 {
	num, den := 0.0, 0.0
	for i := range want {
		d := float64(got[i]) - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	return math.Sqrt(num / den)
}

func config(retrieval, estimation float32) wavekv.Config {
	cfg := wavekv.DefaultConfig()
	cfg.NLayers, cfg.NQHeads, cfg.NKVHeads, cfg.HeadDim = nLayers, nQ, nKV, dim
	cfg.Dtype = wavekv.DtypeF32
	cfg.Threads = 1
	cfg.SegmentTokens = 512
	cfg.UpdateSegmentTokens = 128
	cfg.RetrievalFrac, cfg.EstimationFrac = retrieval, estimation
	return cfg
}

// context is one sequence's K and V of every layer, [tokens][nKV][dim].
type context struct{ k, v [][]float32 }

func newContext(m *model, r *rng, tokens int) *context {
	c := &context{}
	for l := 0; l < nLayers; l++ {
		var k, v []float32
		for t := 0; t < tokens; t++ {
			k, v = m.token(r, k, v)
		}
		c.k, c.v = append(c.k, k), append(c.v, v)
	}
	return c
}

func prefill(t *testing.T, seq *wavekv.Sequence, c *context) {
	t.Helper()
	row := nKV * dim
	for l := uint32(0); l < nLayers; l++ {
		k, v := c.k[l], c.v[l]
		for start := 0; start < len(k); start += chunk * row {
			end := start + chunk*row
			if end > len(k) {
				end = len(k)
			}
			if err := seq.Append(l, wavekv.F32(k[start:end]), wavekv.F32(v[start:end])); err != nil {
				t.Fatal(err)
			}
		}
		if err := seq.EndPrompt(l); err != nil {
			t.Fatal(err)
		}
		info, err := seq.Info(l)
		if err != nil {
			t.Fatal(err)
		}
		if int(info.Tokens) != len(k)/row || info.Clustered == 0 || info.Clusters == 0 {
			t.Fatalf("layer %d after the prompt: %+v", l, info)
		}
	}
}

type outcome struct {
	maxErr float64
	engine *wavekv.Engine
	seqs   []*wavekv.Sequence
	plan   *wavekv.Plan
}

func (o *outcome) close() {
	o.plan.Close()
	for _, s := range o.seqs {
		s.Close()
	}
	o.engine.Close()
}

// run prefills two sequences and decodes `steps` steps for both at every
// layer, returning the largest relative L2 error against exact attention.
func run(t *testing.T, retrieval, estimation float32, lengths [2]int) *outcome {
	t.Helper()
	engine, err := wavekv.Open(config(retrieval, estimation))
	if err != nil {
		t.Fatal(err)
	}
	o := &outcome{engine: engine}
	r := &rng{42}
	m := newModel(r)
	var contexts []*context
	for _, n := range lengths {
		contexts = append(contexts, newContext(m, r, n))
	}
	for _, c := range contexts {
		seq, err := engine.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		prefill(t, seq, c)
		o.seqs = append(o.seqs, seq)
	}
	if o.plan, err = engine.NewPlan(); err != nil {
		t.Fatal(err)
	}
	for step := 0; step < steps; step++ {
		for l := 0; l < nLayers; l++ {
			var q []float32
			for s, c := range contexts {
				k, v := m.token(r, nil, nil)
				if err := o.seqs[s].Append(uint32(l), wavekv.F32(k), wavekv.F32(v)); err != nil {
					t.Fatal(err)
				}
				c.k[l], c.v[l] = append(c.k[l], k...), append(c.v[l], v...)
				q = m.query(r, q)
			}
			out := make([]float32, 2*nQ*dim)
			if err := o.plan.Decode(o.seqs, uint32(l), wavekv.F32(q), wavekv.F32(out)); err != nil {
				t.Fatal(err)
			}
			var want, lse []float64
			for s, c := range contexts {
				want, lse = exactAttention(q[s*nQ*dim:(s+1)*nQ*dim], c.k[l], c.v[l], want, lse)
			}
			o.maxErr = math.Max(o.maxErr, relL2(out, want))
		}
	}
	return o
}

func TestDecodingAtFullRetrievalIsExactAttention(t *testing.T) {
	o := run(t, 1.0, 0.0, [2]int{3000, 2400})
	defer o.close()
	t.Logf("full retrieval: largest relative L2 error %.3e", o.maxErr)
	if o.maxErr >= 1e-4 {
		t.Fatalf("relative L2 error %g", o.maxErr)
	}
}

// wantError checks an error's status, through errors.Is and errors.As, and
// that its message holds each of the words.
func wantError(t *testing.T, err error, status wavekv.Status, words ...string) *wavekv.Error {
	t.Helper()
	if err == nil {
		t.Fatalf("no error; want %v", status)
	}
	if !errors.Is(err, status) {
		t.Fatalf("error %q is not %v", err, status)
	}
	var e *wavekv.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %q is not a *wavekv.Error", err)
	}
	if e.Status != status || e.Message == "" {
		t.Fatalf("error %+v; want status %v and a message", e, status)
	}
	for _, w := range words {
		if !strings.Contains(e.Message, w) {
			t.Fatalf("message %q does not mention %q", e.Message, w)
		}
	}
	return e
}

func TestScenarioDefaultBudgetStatsAndErrors(t *testing.T) {
	defaults := wavekv.DefaultConfig()
	o := run(t, defaults.RetrievalFrac, defaults.EstimationFrac, [2]int{3000, 2400})
	defer o.close()
	t.Logf("default budget: largest relative L2 error %.3f", o.maxErr)
	if o.maxErr >= 0.5 {
		t.Fatalf("relative L2 error %g", o.maxErr)
	}
	engine, seqs, plan := o.engine, o.seqs, o.plan

	// The stats.
	stats, err := engine.Stats()
	if err != nil {
		t.Fatal(err)
	}
	held := uint64((3000 + steps + 2400 + steps) * nLayers)
	if stats.Sequences != 2 || stats.Tokens != held || stats.Clusters == 0 || stats.Segments == 0 {
		t.Fatalf("stats %+v; want 2 sequences, %d tokens, clusters", stats, held)
	}
	if stats.Lookups != steps*nLayers*2 || stats.RetrievedClusters == 0 || stats.EstimatedClusters == 0 {
		t.Fatalf("stats %+v; want %d lookups", stats, steps*nLayers*2)
	}
	json, err := engine.StatsJSON()
	if err != nil || !strings.HasPrefix(json, "{") || !strings.Contains(json, `"tokens"`) {
		t.Fatalf("stats JSON %q, %v", json, err)
	}

	saveAndLoad(t, engine, seqs[0], plan)

	// 1. A bad shape: caught by the binding (a slice that is not whole
	// tokens) and by the library (strides whose rows overlap).
	k := make(wavekv.F32, nKV*dim+10)
	wantError(t, seqs[0].Append(0, k, k), wavekv.ErrInvalidArgument, "wkv_seq_append", "multiple")
	q, out := make(wavekv.F32, 2*nQ*dim), make(wavekv.F32, 2*nQ*dim)
	wantError(t, plan.DecodeStrided(seqs, 0, q, nQ*dim, dim/2, out, 0, 0), wavekv.ErrInvalidArgument, "stride")
	wantError(t, plan.Decode(seqs, 0, q[:nQ*dim], out), wavekv.ErrInvalidArgument, "q")
	half := make(wavekv.F16, nKV*dim)
	wantError(t, seqs[0].Append(0, half, half), wavekv.ErrInvalidArgument, "f16", "f32")
	wantError(t, seqs[0].AppendDevice(0, 1, 1, 1, 0, 0, 0), wavekv.ErrInvalidArgument, "CUDA")

	// 2. An unknown layer, from the library.
	k = make(wavekv.F32, nKV*dim)
	wantError(t, seqs[0].Append(nLayers, k, k), wavekv.ErrOutOfRange, "layer")
	e := wantError(t, plan.Decode(seqs, 7, q, out), wavekv.ErrOutOfRange, "layer")
	// The message was copied: later calls do not change it.
	if _, err := seqs[0].Info(0); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e.Message, "layer") || !strings.HasPrefix(e.Error(), "WKV_ERR_OUT_OF_RANGE: ") {
		t.Fatalf("error %q", e)
	}

	// 3. Use after close: an error, never a dangling handle.
	if err := seqs[1].Close(); err != nil {
		t.Fatal(err)
	}
	if err := seqs[1].Close(); err != nil { // again: a no-op
		t.Fatal(err)
	}
	err = seqs[1].Append(0, k, k)
	wantError(t, err, wavekv.ErrInvalidHandle, "closed")
	if !errors.Is(err, wavekv.ErrClosed) {
		t.Fatalf("%q is not ErrClosed", err)
	}
	_, err = seqs[1].Info(0)
	wantError(t, err, wavekv.ErrInvalidHandle, "closed")
	err = plan.Decode(seqs, 0, q, out)
	wantError(t, err, wavekv.ErrInvalidHandle, "sequence 1", "closed")
	if !errors.Is(err, wavekv.ErrClosed) {
		t.Fatalf("%q is not ErrClosed", err)
	}
	engine.Close()
	_, err = engine.NewSequence()
	wantError(t, err, wavekv.ErrInvalidHandle, "engine is closed")
	_, err = engine.Stats()
	wantError(t, err, wavekv.ErrInvalidHandle)
	if !errors.Is(err, wavekv.ErrClosed) {
		t.Fatalf("%q is not ErrClosed", err)
	}

	// Sequences and plans outlive the engine handle (wavekv.h).
	if err := seqs[0].Append(0, k, k); err != nil {
		t.Fatal(err)
	}
	if err := plan.Decode(seqs[:1], 0, q[:nQ*dim], out[:nQ*dim]); err != nil {
		t.Fatal(err)
	}
	for _, x := range out[:nQ*dim] {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			t.Fatalf("output %v", x)
		}
	}
	plan.Close()
	wantError(t, plan.Decode(seqs[:1], 0, q[:nQ*dim], out[:nQ*dim]), wavekv.ErrInvalidHandle, "plan is closed")
}

// saveAndLoad saves seq (after its decoding steps), loads it into the same
// engine and decodes one query on both at every layer: the outputs must be
// the same bits, since a loaded sequence holds the saved one's index and
// pages unchanged. Then a copy with one byte changed in its middle must be
// refused as corrupt, and the intact file by an engine of another head_dim.
func saveAndLoad(t *testing.T, engine *wavekv.Engine, seq *wavekv.Sequence, plan *wavekv.Plan) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "seq.wkv")
	if err := seq.Save(path, false); err != nil {
		t.Fatal(err)
	}
	before, err := engine.Stats()
	if err != nil {
		t.Fatal(err)
	}
	loaded, err := engine.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	defer loaded.Close()
	if after, err := engine.Stats(); err != nil || after.Sequences != before.Sequences+1 {
		t.Fatalf("stats after the load %+v, %v", after, err)
	}
	r := &rng{5}
	for l := uint32(0); l < nLayers; l++ {
		want, err := seq.Info(l)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := loaded.Info(l); err != nil || got != want {
			t.Fatalf("layer %d: the loaded sequence holds %+v (%v), the saved one %+v", l, got, err, want)
		}
		q := make(wavekv.F32, nQ*dim)
		for i := range q {
			q[i] = float32(r.normal())
		}
		a, b := make(wavekv.F32, nQ*dim), make(wavekv.F32, nQ*dim)
		for i := range b {
			b[i] = 1
		}
		if err := plan.Decode([]*wavekv.Sequence{seq}, l, q, a); err != nil {
			t.Fatal(err)
		}
		if err := plan.Decode([]*wavekv.Sequence{loaded}, l, q, b); err != nil {
			t.Fatal(err)
		}
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("layer %d, element %d: %v from the saved sequence, %v from the loaded one", l, i, a[i], b[i])
			}
		}
	}
	loaded.Close()

	// One byte changed in the middle of the file: refused, and nothing of it
	// is left in the engine. Counted again here: the plan still refers to
	// the closed loaded sequence until its next lookup, which keeps it alive
	// (wavekv.h).
	if before, err = engine.Stats(); err != nil {
		t.Fatal(err)
	}
	bytes, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	bytes[len(bytes)/2] ^= 0x5a
	corrupt := filepath.Join(dir, "corrupt.wkv")
	if err := os.WriteFile(corrupt, bytes, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = engine.Load(corrupt)
	e := wantError(t, err, wavekv.ErrCorrupt, "section")
	if !strings.HasPrefix(e.Error(), "WKV_ERR_CORRUPT: ") {
		t.Fatalf("error %q", e)
	}
	if after, err := engine.Stats(); err != nil || after.Sequences != before.Sequences {
		t.Fatalf("stats after the refused load %+v, %v", after, err)
	}

	// An engine of another shape: the message names the difference.
	cfg := config(1.0, 0.0)
	cfg.HeadDim = 2 * dim
	other, err := wavekv.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	_, err = other.Load(path)
	wantError(t, err, wavekv.ErrInvalidArgument, "head_dim")

	// Refused by the binding (a NUL would cut the path short in C) and by
	// the library (no such file).
	_, err = engine.Load("seq\x00.wkv")
	wantError(t, err, wavekv.ErrInvalidArgument, "NUL")
	_, err = engine.Load(filepath.Join(dir, "missing.wkv"))
	wantError(t, err, wavekv.ErrIO)
}

// Attending with your own kernel: Lookup, Assemble, attention over the
// execution buffer computed here, Merge, Update; the result matches Decode,
// and so does Attend.
func TestOwnAttentionOverTheExecutionBufferMergesToDecode(t *testing.T) {
	engine, err := wavekv.Open(config(0.05, 0.3))
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	r := &rng{7}
	m := newModel(r)
	var seqs []*wavekv.Sequence
	for _, n := range []int{1500, 1100} {
		seq, err := engine.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		defer seq.Close()
		prefill(t, seq, newContext(m, r, n))
		seqs = append(seqs, seq)
	}
	q := m.query(r, m.query(r, nil))
	const layer = 1
	plan, err := engine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer plan.Close()

	mine, lse := make(wavekv.F32, 2*nQ*dim), make([]float32, 2*nQ)
	wantError(t, plan.Attend(mine, nil), wavekv.ErrState, "Lookup")
	if err := plan.Lookup(seqs, layer, wavekv.F32(q)); err != nil {
		t.Fatal(err)
	}
	wantError(t, plan.Attend(mine, nil), wavekv.ErrState) // from the library: no assemble yet
	// The step that failed may be gone: look up again.
	if err := plan.Lookup(seqs, layer, wavekv.F32(q)); err != nil {
		t.Fatal(err)
	}
	if err := plan.Assemble(); err != nil {
		t.Fatal(err)
	}
	x, err := plan.Xbuf()
	if err != nil {
		t.Fatal(err)
	}
	if x.NRuns != 2*nKV || x.Offsets[0] != 0 || x.HeadDim != dim {
		t.Fatalf("xbuf %d runs, offsets %v, head_dim %d", x.NRuns, x.Offsets, x.HeadDim)
	}
	xk, xv := x.K.(wavekv.F32), x.V.(wavekv.F32)
	if _, _, ok := x.Run(2 * nKV); ok {
		t.Fatal("a run past the last")
	}
	for s := 0; s < 2; s++ {
		for h := 0; h < nQ; h++ {
			lo, hi, ok := x.Run(s*nKV + h/(nQ/nKV))
			if !ok || hi <= lo || hi*dim > len(xk) {
				t.Fatalf("run of sequence %d, head %d is empty", s, h)
			}
			// exactAttention over the run's tokens, as if every KV head held
			// them, with this head's query in query head 0.
			var kk, vv []float32
			for tok := lo; tok < hi; tok++ {
				for g := 0; g < nKV; g++ {
					kk = append(kk, xk[tok*dim:(tok+1)*dim]...)
					vv = append(vv, xv[tok*dim:(tok+1)*dim]...)
				}
			}
			qq := make([]float32, nQ*dim)
			copy(qq, q[(s*nQ+h)*dim:(s*nQ+h+1)*dim])
			o, l := exactAttention(qq, kk, vv, nil, nil)
			for i := 0; i < dim; i++ {
				mine[(s*nQ+h)*dim+i] = float32(o[i])
			}
			lse[s*nQ+h] = float32(l[0])
		}
	}
	if err := plan.Merge(mine, lse); err != nil {
		t.Fatal(err)
	}
	if err := plan.Update(); err != nil {
		t.Fatal(err)
	}

	other, err := engine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	decoded := make(wavekv.F32, 2*nQ*dim)
	if err := other.Decode(seqs, layer, wavekv.F32(q), decoded); err != nil {
		t.Fatal(err)
	}
	want := make([]float64, len(decoded))
	for i, x := range decoded {
		want[i] = float64(x)
	}
	if e := relL2(mine, want); e >= 1e-5 {
		t.Fatalf("merged own attention vs decode: %g", e)
	}

	attended, lse2 := make(wavekv.F32, 2*nQ*dim), make([]float32, 2*nQ)
	if err := plan.Lookup(seqs, layer, wavekv.F32(q)); err != nil {
		t.Fatal(err)
	}
	if err := plan.Assemble(); err != nil {
		t.Fatal(err)
	}
	if err := plan.Attend(attended, lse2); err != nil {
		t.Fatal(err)
	}
	if err := plan.Update(); err != nil {
		t.Fatal(err)
	}
	if e := relL2(attended, want); e >= 1e-5 {
		t.Fatalf("attend vs decode: %g", e)
	}
	for i := range lse {
		if math.Abs(float64(lse[i]-lse2[i])) >= 1e-3 {
			t.Fatalf("lse %v vs %v", lse, lse2)
		}
	}
}

func TestStatusesMatchTheLibrary(t *testing.T) {
	names := map[wavekv.Status]string{
		wavekv.ErrInvalidArgument: "WKV_ERR_INVALID_ARGUMENT", wavekv.ErrInvalidHandle: "WKV_ERR_INVALID_HANDLE",
		wavekv.ErrOutOfRange: "WKV_ERR_OUT_OF_RANGE", wavekv.ErrUnsupported: "WKV_ERR_UNSUPPORTED",
		wavekv.ErrBudget: "WKV_ERR_BUDGET", wavekv.ErrOutOfMemory: "WKV_ERR_OUT_OF_MEMORY",
		wavekv.ErrDevice: "WKV_ERR_DEVICE", wavekv.ErrIO: "WKV_ERR_IO", wavekv.ErrCorrupt: "WKV_ERR_CORRUPT",
		wavekv.ErrState: "WKV_ERR_STATE", wavekv.ErrInternal: "WKV_ERR_INTERNAL",
		wavekv.ErrNoDevice: "WKV_ERR_NO_DEVICE",
	}
	for s, name := range names {
		if s.String() != name || s.Error() != name {
			t.Errorf("status %d is %q, want %q", int32(s), s.String(), name)
		}
	}
	if got := wavekv.Status(99).String(); got != "WKV_ERR_UNKNOWN(99)" {
		t.Errorf("status 99 is %q", got)
	}
	a, b, c := wavekv.Version()
	if v := wavekv.VersionString(); v == "" || !strings.HasPrefix(v, strings.Join([]string{itoa(a), itoa(b), itoa(c)}, ".")) {
		t.Errorf("version %q vs %d.%d.%d", v, a, b, c)
	}
	e := &wavekv.Error{Status: wavekv.ErrBudget, Message: "m"}
	if !errors.Is(e, wavekv.ErrBudget) || errors.Is(e, wavekv.ErrIO) || errors.Is(e, wavekv.ErrClosed) {
		t.Errorf("errors.Is on %v", e)
	}
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + itoa(i%10)
}

func TestEngineServesGoroutinesAndSharedHandles(t *testing.T) {
	// Full retrieval, so that each result must equal exact attention.
	engine, err := wavekv.Open(config(1.0, 0.0))
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	// Each goroutine its own sequence and plan; all of them also decode one
	// shared sequence with their own plans, and one goroutine appends to it:
	// the binding serialises the calls that the header says must not overlap.
	r := &rng{99}
	m := newModel(r)
	shared, err := engine.NewSequence()
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	prefill(t, shared, newContext(m, r, 600))
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 3; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			r := &rng{uint64(100 + g)}
			m := newModel(r)
			c := newContext(m, r, 900)
			seq, err := engine.NewSequence()
			if err != nil {
				errs <- err
				return
			}
			defer seq.Close()
			for l := uint32(0); l < nLayers; l++ {
				if err := seq.Append(l, wavekv.F32(c.k[l]), wavekv.F32(c.v[l])); err != nil {
					errs <- err
					return
				}
			}
			plan, err := engine.NewPlan()
			if err != nil {
				errs <- err
				return
			}
			defer plan.Close()
			for i := 0; i < 5; i++ {
				q := m.query(r, m.query(r, nil))
				out := make(wavekv.F32, 2*nQ*dim)
				if err := plan.Decode([]*wavekv.Sequence{seq, shared}, 0, wavekv.F32(q), out); err != nil {
					errs <- err
					return
				}
				if g == 0 {
					k, v := m.token(r, nil, nil)
					if err := shared.Append(0, wavekv.F32(k), wavekv.F32(v)); err != nil {
						errs <- err
						return
					}
				}
				want, _ := exactAttention(q[:nQ*dim], c.k[0], c.v[0], nil, nil)
				if e := relL2(out[:nQ*dim], want); e >= 1e-4 {
					errs <- fmt.Errorf("goroutine %d, step %d: relative L2 error %g", g, i, e)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	stats, err := engine.Stats()
	if err != nil || stats.Sequences != 1 {
		t.Fatalf("stats %+v, %v", stats, err)
	}
}

func TestConfigReadsBackAndBadConfigsAreRefused(t *testing.T) {
	engine, err := wavekv.Open(config(0.1, 0.2))
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	c, err := engine.Config()
	if err != nil {
		t.Fatal(err)
	}
	if c.NLayers != 2 || c.NQHeads != 4 || c.NKVHeads != 2 || c.HeadDim != 64 || c.SegmentTokens != 512 ||
		c.Dtype != wavekv.DtypeF32 || math.Abs(float64(c.RetrievalFrac)-0.1) > 1e-6 {
		t.Fatalf("config %+v", c)
	}
	if engine.Device() != wavekv.DeviceCPU || engine.Dtype() != wavekv.DtypeF32 {
		t.Fatalf("device %v dtype %v", engine.Device(), engine.Dtype())
	}
	bad := config(0.1, 0.2)
	bad.NKVHeads = 3
	_, err = wavekv.Open(bad)
	wantError(t, err, wavekv.ErrInvalidArgument)
	bad = config(0.1, 0.2)
	bad.HeadDim = 63
	_, err = wavekv.Open(bad)
	wantError(t, err, wavekv.ErrUnsupported)
}

// Pages of 8-bit rows (0.10): the engine's configuration says so, and with
// every cluster retrieved a decode is attention over the 8-bit rows of the
// clustered segments, close to exact attention over the rows as appended. A
// format the header does not list is refused.
func TestInt8PagesDecodeCloseToExactAttention(t *testing.T) {
	if f := wavekv.DefaultConfig().PageFormat; f != wavekv.PageFormatStorage {
		t.Fatalf("default page format %v", f)
	}
	// Centered keys (0.11) likewise, keys less their clusters' centroids.
	for _, f := range []wavekv.PageFormat{wavekv.PageFormatInt8, wavekv.PageFormatInt8Centered} {
		cfg := config(1.0, 0.0)
		cfg.PageFormat = f
		engine, err := wavekv.Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer engine.Close()
		c, err := engine.Config()
		if err != nil {
			t.Fatal(err)
		}
		if c.PageFormat != f || c.Dtype != wavekv.DtypeF32 {
			t.Fatalf("config %+v", c)
		}
		r := &rng{21}
		m := newModel(r)
		ctx := newContext(m, r, 1200)
		seq, err := engine.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		defer seq.Close()
		prefill(t, seq, ctx)
		plan, err := engine.NewPlan()
		if err != nil {
			t.Fatal(err)
		}
		defer plan.Close()
		q := m.query(r, nil)
		out := make(wavekv.F32, nQ*dim)
		if err := plan.Decode([]*wavekv.Sequence{seq}, 0, wavekv.F32(q), out); err != nil {
			t.Fatal(err)
		}
		want, _ := exactAttention(q, ctx.k[0], ctx.v[0], nil, nil)
		if e := relL2(out, want); e >= 0.05 {
			t.Fatalf("%v: relative L2 error %g", f, e)
		}
	}

	bad := config(1.0, 0.0)
	bad.PageFormat = 3
	_, err := wavekv.Open(bad)
	wantError(t, err, wavekv.ErrInvalidArgument, "page_format")
}

// The spill tier: an evicted sequence gives its pages back, its next decode
// reads them back and gives the same bits; without a spill directory the
// eviction is refused.
func TestEvictedSequencesDecodeTheSameAfterTheirRestore(t *testing.T) {
	cfg := config(0.018, 0.232)
	cfg.SpillDir = t.TempDir()
	engine, err := wavekv.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	if got, err := engine.Config(); err != nil || got.SpillDir != cfg.SpillDir {
		t.Fatalf("config spill dir %q (%v), want %q", got.SpillDir, err, cfg.SpillDir)
	}
	r := &rng{9}
	m := newModel(r)
	c := newContext(m, r, 3000)
	seq, err := engine.NewSequence()
	if err != nil {
		t.Fatal(err)
	}
	defer seq.Close()
	prefill(t, seq, c)
	plan, err := engine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer plan.Close()
	q := wavekv.F32(m.query(r, nil))
	decodeAll := func() []float32 {
		var all []float32
		for l := uint32(0); l < nLayers; l++ {
			out := make([]float32, nQ*dim)
			if err := plan.Decode([]*wavekv.Sequence{seq}, l, q, wavekv.F32(out)); err != nil {
				t.Fatal(err)
			}
			all = append(all, out...)
		}
		return all
	}
	// Every layer's info: evicted with every page in the spill file, or
	// in memory with none there.
	spilled := func(evicted bool) {
		t.Helper()
		for l := uint32(0); l < nLayers; l++ {
			info, err := seq.Info(l)
			if err != nil {
				t.Fatal(err)
			}
			want := uint64(0)
			if evicted {
				want = info.Pages
			}
			if info.Pages == 0 || info.Evicted != evicted || info.SpilledPages != want {
				t.Fatalf("layer %d: info %+v, want evicted %v and %d spilled pages", l, info, evicted, want)
			}
		}
	}
	before := decodeAll()
	spilled(false)
	if err := seq.Evict(); err != nil {
		t.Fatal(err)
	}
	spilled(true)
	if st, err := engine.Stats(); err != nil || st.EvictedSequences != 1 || st.SpillBytesUsed == 0 || st.SpillIO == 0 {
		t.Fatalf("stats after the eviction %+v, %v", st, err)
	}
	after := decodeAll()
	for i := range before {
		if math.Float32bits(before[i]) != math.Float32bits(after[i]) {
			t.Fatalf("output %d: %g after the restore, %g before", i, after[i], before[i])
		}
	}
	if err := seq.Evict(); err != nil {
		t.Fatal(err)
	}
	if err := seq.Restore(); err != nil {
		t.Fatal(err)
	}
	spilled(false)
	if st, err := engine.Stats(); err != nil || st.EvictedSequences != 0 || st.SpillBytesUsed != 0 {
		t.Fatalf("stats after the restore %+v, %v", st, err)
	}

	plain, err := wavekv.Open(config(0.018, 0.232))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	other, err := plain.NewSequence()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	wantError(t, other.Evict(), wavekv.ErrState, "spill_dir")
}

// TestBatchAppendDecodesAsOneAppendPerSequence: wkv_append_batch (0.5). Each
// step's new tokens appended to three sequences in one call decode bit for
// bit as the same tokens appended to each with wkv_seq_append: one token a
// step, three every 50th (speculative decoding), through AppendBatch (layer
// 0) and, on layer 1, AppendBatchStrided over a layout interleaved by token
// with padded heads, over enough generated tokens that segments complete
// and are clustered (index growths) under both.
func TestBatchAppendDecodesAsOneAppendPerSequence(t *testing.T) {
	const (
		n     = 3
		steps = 280 // 320 tokens: past UpdateSegmentTokens (128) twice
		hs    = dim + 8
		row   = nKV * dim
	)
	cfg := config(0.018, 0.232)
	open := func() *wavekv.Engine {
		e, err := wavekv.Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	batchEngine, singleEngine := open(), open()
	defer batchEngine.Close()
	defer singleEngine.Close()
	r := &rng{s: 7}
	m := newModel(r)
	var contexts []*context
	for _, tokens := range []int{1500, 900, 2100} {
		contexts = append(contexts, newContext(m, r, tokens))
	}
	newSeqs := func(e *wavekv.Engine) []*wavekv.Sequence {
		var seqs []*wavekv.Sequence
		for i := 0; i < n; i++ {
			s, err := e.NewSequence()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			prefill(t, s, contexts[i])
			seqs = append(seqs, s)
		}
		return seqs
	}
	batch, single := newSeqs(batchEngine), newSeqs(singleEngine)
	var promptClustered []uint64
	for _, s := range single {
		info, err := s.Info(0)
		if err != nil {
			t.Fatal(err)
		}
		promptClustered = append(promptClustered, info.Clustered)
	}
	batchPlan, err := batchEngine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer batchPlan.Close()
	singlePlan, err := singleEngine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer singlePlan.Close()

	compared, generated := 0, 0
	for step := 0; step < steps; step++ {
		nTok := 1
		if step%50 == 49 {
			nTok = 3
		}
		generated += nTok
		for layer := uint32(0); layer < nLayers; layer++ {
			// Packed [n][nTok][nKV][dim].
			var k, v []float32
			for i := 0; i < n*nTok; i++ {
				k, v = m.token(r, k, v)
			}
			if layer == 0 {
				if err := wavekv.AppendBatch(batch, layer, wavekv.F32(k), wavekv.F32(v)); err != nil {
					t.Fatal(err)
				}
			} else {
				// [nTok][n][nKV][hs]: sequence i at i * nKV * hs; the
				// padding, NaN, must never be read.
				kp, vp := make(wavekv.F32, nTok*n*nKV*hs), make(wavekv.F32, nTok*n*nKV*hs)
				for i := range kp {
					kp[i], vp[i] = float32(math.NaN()), float32(math.NaN())
				}
				for i := 0; i < n; i++ {
					for tk := 0; tk < nTok; tk++ {
						for h := 0; h < nKV; h++ {
							from, to := ((i*nTok+tk)*nKV+h)*dim, ((tk*n+i)*nKV+h)*hs
							copy(kp[to:to+dim], k[from:from+dim])
							copy(vp[to:to+dim], v[from:from+dim])
						}
					}
				}
				if err := wavekv.AppendBatchStrided(batch, layer, kp, vp, uint32(nTok), nKV*hs, n*nKV*hs, hs); err != nil {
					t.Fatal(err)
				}
			}
			per := nTok * row
			for i, s := range single {
				if err := s.Append(layer, wavekv.F32(k[i*per:(i+1)*per]), wavekv.F32(v[i*per:(i+1)*per])); err != nil {
					t.Fatal(err)
				}
			}
			if step%25 == 24 || step+1 == steps {
				var q []float32
				for i := 0; i < n; i++ {
					q = m.query(r, q)
				}
				got, want := make(wavekv.F32, n*nQ*dim), make(wavekv.F32, n*nQ*dim)
				if err := batchPlan.Decode(batch, layer, wavekv.F32(q), got); err != nil {
					t.Fatal(err)
				}
				if err := singlePlan.Decode(single, layer, wavekv.F32(q), want); err != nil {
					t.Fatal(err)
				}
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("step %d, layer %d, element %d: %v from the batch append, %v from one append each",
							step, layer, i, got[i], want[i])
					}
				}
				compared++
			}
		}
	}
	if compared != 2*(steps/25+1) {
		t.Fatalf("compared %d times", compared)
	}
	for i := 0; i < n; i++ {
		for layer := uint32(0); layer < nLayers; layer++ {
			b, err1 := batch[i].Info(layer)
			s, err2 := single[i].Info(layer)
			if err1 != nil || err2 != nil || b != s {
				t.Fatalf("sequence %d, layer %d: %+v (%v) after batch appends, %+v (%v) after single ones",
					i, layer, b, err1, s, err2)
			}
			if int(b.Tokens) != len(contexts[i].k[0])/row+generated {
				t.Fatalf("sequence %d, layer %d holds %d tokens", i, layer, b.Tokens)
			}
			if layer == 0 && b.Clustered <= promptClustered[i] {
				t.Fatalf("sequence %d: no segment completed while generating (%d clustered tokens)", i, b.Clustered)
			}
		}
	}
	bs, err1 := batchEngine.Stats()
	ss, err2 := singleEngine.Stats()
	if err1 != nil || err2 != nil || bs.Tokens != ss.Tokens || bs.Segments != ss.Segments || bs.Clusters != ss.Clusters {
		t.Fatalf("stats %+v (%v) after batch appends, %+v (%v) after single ones", bs, err1, ss, err2)
	}
}

// TestBatchAppendRefusesBadBatches: what AppendBatch refuses, in the binding
// and in the library, with its status and message; a refused batch appends
// nothing.
func TestBatchAppendRefusesBadBatches(t *testing.T) {
	const row = nKV * dim
	open := func() *wavekv.Engine {
		e, err := wavekv.Open(config(1, 0))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	engine, other := open(), open()
	newSeq := func(e *wavekv.Engine) *wavekv.Sequence {
		s, err := e.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	a, b, c, x := newSeq(engine), newSeq(engine), newSeq(engine), newSeq(other)
	kv := make(wavekv.F32, 2*row)
	for i := range kv {
		kv[i] = 0.5
	}
	ab := []*wavekv.Sequence{a, b}
	fn := "wkv_append_batch: "

	// The binding's checks.
	wantError(t, wavekv.AppendBatch(ab, 0, kv[:2*row-8], kv[:2*row-8]), wavekv.ErrInvalidArgument,
		fn, "multiple", "n_seqs x n_kv_heads x head_dim")
	wantError(t, wavekv.AppendBatch(ab, 0, kv, kv[:row]), wavekv.ErrInvalidArgument, fn, "v has")
	half := make(wavekv.F16, 2*row)
	wantError(t, wavekv.AppendBatch(ab, 0, half, half), wavekv.ErrInvalidArgument, fn, "f16", "f32")
	wantError(t, wavekv.AppendBatch(nil, 0, kv, kv), wavekv.ErrInvalidArgument, fn+"n_seqs is 0")
	wantError(t, wavekv.AppendBatch([]*wavekv.Sequence{a, nil}, 0, kv, kv), wavekv.ErrInvalidHandle,
		fn+"sequence 1 of the batch is nil")
	wantError(t, wavekv.AppendBatch([]*wavekv.Sequence{a, b, a}, 0, kv, kv), wavekv.ErrInvalidArgument,
		fn, "multiple")
	wantError(t, wavekv.AppendBatchStrided(ab, 0, kv, kv[:2*row-1], 1, 0, 0, 0), wavekv.ErrInvalidArgument,
		fn, "v has", "fewer than")
	wantError(t, wavekv.AppendBatchStrided(ab, 0, kv, kv, 1, row+1, 0, 0), wavekv.ErrInvalidArgument,
		fn, "fewer than")
	wantError(t, wavekv.AppendBatchStrided(ab, 0, kv, kv, 1, -1, 0, 0), wavekv.ErrInvalidArgument,
		fn, "must not be negative")
	wantError(t, wavekv.AppendBatchDevice(ab, 0, 1, 1, 1, 0, 0, 0, 0), wavekv.ErrInvalidArgument, fn, "CUDA")
	// A sequence listed twice: refused before any lock is taken twice.
	wantError(t, wavekv.AppendBatch([]*wavekv.Sequence{a, a}, 0, kv, kv), wavekv.ErrInvalidArgument,
		fn+"a sequence is listed twice")

	// The library's: sequences of two engines, a layer.
	wantError(t, wavekv.AppendBatch([]*wavekv.Sequence{a, x}, 0, kv, kv), wavekv.ErrInvalidHandle,
		fn+"sequence 1 belongs to another engine")
	wantError(t, wavekv.AppendBatch(ab, nLayers, kv, kv), wavekv.ErrOutOfRange, fn)

	// A closed sequence.
	c.Close()
	err := wavekv.AppendBatch([]*wavekv.Sequence{a, c}, 0, kv, kv)
	wantError(t, err, wavekv.ErrInvalidHandle, fn+"sequence 1 of the batch is closed")
	if !errors.Is(err, wavekv.ErrClosed) {
		t.Fatalf("%q is not ErrClosed", err)
	}

	for _, s := range []*wavekv.Sequence{a, b, x} {
		if info, err := s.Info(0); err != nil || info.Tokens != 0 {
			t.Fatalf("a refused batch appended: %+v, %v", info, err)
		}
	}
	// The sequences were unlocked after each refusal: a good batch works.
	if err := wavekv.AppendBatch(ab, 0, kv, kv); err != nil {
		t.Fatal(err)
	}
	for _, s := range ab {
		if info, err := s.Info(0); err != nil || info.Tokens != 1 {
			t.Fatalf("after a batch of one token: %+v, %v", info, err)
		}
	}
}

// TestBatchAppendsFromGoroutines: goroutines appending to overlapping
// batches listed in different orders, while another decodes them, never
// deadlock (every call locks in one order) and lose no token.
func TestBatchAppendsFromGoroutines(t *testing.T) {
	const (
		row   = nKV * dim
		iters = 100
	)
	engine, err := wavekv.Open(config(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	var seqs []*wavekv.Sequence
	for i := 0; i < 3; i++ {
		s, err := engine.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		seqs = append(seqs, s)
	}
	a, b, c := seqs[0], seqs[1], seqs[2]
	orders := [][]*wavekv.Sequence{{a, b}, {b, a}, {c, b, a}, {a, c}}
	var wg sync.WaitGroup
	errs := make(chan error, len(orders)+1)
	for _, order := range orders {
		wg.Add(1)
		go func(order []*wavekv.Sequence) {
			defer wg.Done()
			kv := make(wavekv.F32, len(order)*row)
			for i := range kv {
				kv[i] = float32(i%5) * 0.25
			}
			for i := 0; i < iters; i++ {
				if err := wavekv.AppendBatch(order, 0, kv, kv); err != nil {
					errs <- err
					return
				}
			}
		}(order)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		plan, err := engine.NewPlan()
		if err != nil {
			errs <- err
			return
		}
		defer plan.Close()
		q, out := make(wavekv.F32, 3*nQ*dim), make(wavekv.F32, 3*nQ*dim)
		for i := 0; i < iters; i++ {
			// Before a sequence's first append, an empty layer is an
			// error, which is fine here.
			_ = plan.Decode([]*wavekv.Sequence{c, a, b}, 0, q, out)
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	want := map[*wavekv.Sequence]uint64{}
	for _, order := range orders {
		for _, s := range order {
			want[s] += iters
		}
	}
	for i, s := range seqs {
		if info, err := s.Info(0); err != nil || info.Tokens != want[s] {
			t.Fatalf("sequence %d holds %+v (%v); want %d tokens", i, info, err, want[s])
		}
	}
}

// TestCPUEngineRefusesToBindAPlan: steps a runtime captures (wkv_plan_bind,
// ABI 0.9) need a CUDA engine. A CPU engine refuses the binding, leaving the
// plan unbound (Prepare and Unbind: ErrState) and it and its sequences
// usable and unlocked; a closed plan, or a closed sequence in the batch, is
// refused before calling in.
func TestCPUEngineRefusesToBindAPlan(t *testing.T) {
	const row = nKV * dim
	engine, err := wavekv.Open(config(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	newSeq := func() *wavekv.Sequence {
		s, err := engine.NewSequence()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	a, b := newSeq(), newSeq()
	kv := make(wavekv.F32, 4*row)
	for i := range kv {
		kv[i] = 0.5
	}
	for _, s := range []*wavekv.Sequence{a, b} {
		for l := uint32(0); l < nLayers; l++ {
			if err := s.Append(l, kv, kv); err != nil {
				t.Fatal(err)
			}
		}
	}
	plan, err := engine.NewPlan()
	if err != nil {
		t.Fatal(err)
	}
	defer plan.Close()
	ab := []*wavekv.Sequence{a, b}

	wantError(t, plan.Bind(ab, 16, 0), wavekv.ErrUnsupported, "wkv_plan_bind: ")
	wantError(t, plan.Prepare(0), wavekv.ErrState, "wkv_plan_prepare: ", "not bound")
	wantError(t, plan.Unbind(0), wavekv.ErrState, "wkv_plan_unbind: ", "not bound")
	// The binding's checks.
	wantError(t, plan.Bind([]*wavekv.Sequence{a, a}, 0, 0), wavekv.ErrInvalidArgument,
		"wkv_plan_bind: a sequence is listed twice")
	wantError(t, plan.Bind([]*wavekv.Sequence{a, nil}, 0, 0), wavekv.ErrInvalidHandle,
		"wkv_plan_bind: sequence 1 of the batch is nil")

	// Not bound, and unlocked: the sequences take appends and the plan decodes.
	if err := a.Append(0, kv[:row], kv[:row]); err != nil {
		t.Fatal(err)
	}
	q, out := make(wavekv.F32, 2*nQ*dim), make(wavekv.F32, 2*nQ*dim)
	if err := plan.Decode(ab, 0, q, out); err != nil {
		t.Fatal(err)
	}

	b.Close()
	err = plan.Bind(ab, 0, 0)
	wantError(t, err, wavekv.ErrInvalidHandle, "wkv_plan_bind: sequence 1 of the batch is closed")
	if !errors.Is(err, wavekv.ErrClosed) {
		t.Fatalf("%q is not ErrClosed", err)
	}
	plan.Close()
	for _, err := range []error{plan.Bind([]*wavekv.Sequence{a}, 0, 0), plan.Prepare(0), plan.Unbind(0)} {
		wantError(t, err, wavekv.ErrInvalidHandle, "plan is closed")
		if !errors.Is(err, wavekv.ErrClosed) {
			t.Fatalf("%q is not ErrClosed", err)
		}
	}
}
