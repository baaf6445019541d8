package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
)

// latencyRun is one steady-state run: rows sent at Rate per second in 1-row
// transactions, and the send → consumer latency of each.
type latencyRun struct {
	Name     string
	Rate     int           // target rows/s
	Achieved float64       // rows/s actually sent
	Stats    latencyStats  // send → consumer
	Stored   latencyStats  // send → stored in the stream (server timestamp)
	CPU      usage         // during the step (the producer's backends count in Postgres, the bench in Client)
	Wall     time.Duration // the step's duration, the consumer's drain included
	// MaxUnsent is the most WAL jetbox's walsender had not sent yet during
	// the step, in bytes (-1: not sampled): a lag upstream of jetbox.
	MaxUnsent int64
	// Floor is INSERT → XLogData received by a bare pglogrepl client on a
	// slot of its own, for the same rows (floor.go); zero where not measured.
	Floor  latencyStats
	Beyond latencyStats // row by row: the forwarder's latency minus the floor's
	// With --trace (jetbox's publish spans, row by row): Behind is from the
	// floor's XLogData to jetbox's (the span's start), Own from there to
	// stored in the stream (jetbox and the NATS server).
	Behind, Own latencyStats
	// Behind split at the walsender's send time (XLogData's): Sent from the
	// floor's XLogData to jetbox's walsender sending the row, Read from there
	// to jetbox reading it (the socket and jetbox's read buffer).
	Sent, Read latencyStats
	Tail       tailSplit // where the rows above the forwarder's p99 spent their time
	Err        error
}

// tailSplit follows the rows slower than a step's p99 through the pipeline:
// the mean time each spent before the bare client had it (Postgres: commit,
// WAL, walsender), from there to stored in the stream (the forwarder and
// the NATS server), and from stored to the consumer.
type tailSplit struct {
	N                             int
	Upstream                      int // rows whose floor latency was within 1 ms of their whole latency
	Traced                        int // rows with jetbox's span (--trace): ToReceived and ToOwn are theirs
	SentKnown                     int // of those, with the walsender's send time: ToRead is theirs
	ToFloor, ToStored, ToConsumer time.Duration
	ToReceived                    time.Duration // floor → jetbox received the row (its walsender and socket)
	ToRead                        time.Duration // of ToReceived: from jetbox's walsender sending the row to jetbox reading it
	ToOwn                         time.Duration // jetbox read the row → stored (jetbox and the NATS server)
}

// maxSustainedP99 tells a rate the pipeline sustains from one it does not:
// a backlog growing through a step pushes p99 into the seconds.
const maxSustainedP99 = 250 * time.Millisecond

// sustains reports whether the rate was kept (≥ 95%) with no growing backlog.
func (r latencyRun) sustains() bool {
	return r.Err == nil && r.Achieved >= 0.95*float64(r.Rate) && r.Stats.P99 < maxSustainedP99
}

// flat reports whether the rate was kept with p99 at or below maxP99.
func (r latencyRun) flat(maxP99 time.Duration) bool {
	return r.sustains() && r.Stats.P99 <= maxP99
}

// sender sends one steady-state message from writer w.
type sender func(ctx context.Context, w int, payload []byte) error

// steadyLoad drives one consumer's stream with paced senders.
type steadyLoad struct {
	b        *bench
	fwd      *process      // the forwarder, measured; nil for the raw publish
	slot     string        // jetbox's slot, whose walsender's lag is sampled; "" for none
	floor    *floorClient  // the latency floor on the same rows; nil for none
	spans    *otlpReceiver // jetbox's publish spans (--trace); nil for none
	consumer *latencyConsumer
	send     sender
	sent     int    // messages sent since the consumer started
	base     uint64 // messages the stream held before
	shape    loadShape
}

// loadShape is what one send commits: txRows rows (0: one) of payload bytes
// each (0: cfg.PayloadSize).
type loadShape struct{ payload, txRows int }

func (s loadShape) size(b *bench) int {
	if s.payload > 0 {
		return s.payload
	}
	return b.cfg.PayloadSize
}

func (s loadShape) rows() int { return max(1, s.txRows) }

// total is the number of messages the stream should hold.
func (l *steadyLoad) total() uint64 { return l.base + uint64(l.sent) }

// step sends at rate rows/s for d, waits until the consumer has every
// message, and returns the step's latencies.
func (l *steadyLoad) step(ctx context.Context, name string, rate int, d time.Duration) latencyRun {
	l.b.log.Info().Str("workload", name).Int("rate", rate).Stringer("duration", d).Msg("steady state")
	began := time.Now()
	m, err := l.b.startMeter(l.fwd)
	if err != nil {
		return latencyRun{Name: name, Rate: rate, Err: err}
	}
	var lag *unsentSampler
	if l.slot != "" {
		lag = l.b.sampleUnsent(ctx, l.slot)
	}
	rows := l.shape.rows() // rate is in rows/s; produce paces sends (transactions of rows)
	sent, elapsed, err := l.b.produce(ctx, max(1, rate/rows), d, l.send, l.shape.size(l.b))
	sent *= rows
	l.sent += sent
	if err == nil {
		err = l.consumer.waitCount(ctx, l.sent, l.b.cfg.Timeout)
	}
	if err == nil && l.floor != nil {
		err = l.floor.waitCount(ctx, l.sent, l.b.cfg.Timeout)
	}
	cpu, cpuErr := m.read(l.fwd, true)
	maxUnsent := int64(-1)
	if lag != nil {
		maxUnsent = lag.finish()
	}
	samples := l.consumer.take()
	run := latencyRun{Name: name, Rate: rate, CPU: cpu, Wall: time.Since(began), MaxUnsent: maxUnsent, Err: errors.Join(err, cpuErr)}
	if l.floor != nil {
		floor := l.floor.take()
		var spans map[string]spanTimes
		if l.spans != nil {
			ids := make([]string, len(samples))
			for i, s := range samples {
				ids[i] = s.id
			}
			spans = l.spans.take(ctx, ids, 10*time.Second)
		}
		if run.Err == nil {
			run.Err = run.setFloor(samples, floor, spans)
		}
	}
	toConsumer, toStored := make([]time.Duration, len(samples)), make([]time.Duration, len(samples))
	for i, s := range samples {
		toConsumer[i], toStored[i] = s.consumer, s.stored
	}
	run.Stats, run.Stored = summarize(toConsumer), summarize(toStored)
	if elapsed > 0 {
		run.Achieved = float64(sent) / elapsed.Seconds()
	}
	l.b.log.Info().Str("workload", name).Float64("achieved", run.Achieved).Stringer("p50", run.Stats.P50).
		Stringer("p99", run.Stats.P99).Stringer("p99_stored", run.Stored.P99).Stringer("p99_floor", run.Floor.P99).
		Stringer("p99_beyond_floor", run.Beyond.P99).Err(err).Msg("steady state done")
	return run
}

// setFloor joins the step's samples with the floor's latencies of the same
// rows (by outbox id): the floor's percentiles, the forwarder's latency
// beyond it row by row, and the split of the rows above the step's p99.
func (r *latencyRun) setFloor(samples []latencySample, floor map[string]time.Duration, spans map[string]spanTimes) error {
	floors := make([]time.Duration, 0, len(floor))
	for _, d := range floor {
		floors = append(floors, d)
	}
	r.Floor = summarize(floors)
	beyond := make([]time.Duration, len(samples))
	total := make([]time.Duration, len(samples))
	for i, s := range samples {
		f, ok := floor[s.id]
		if !ok {
			return fmt.Errorf("the floor client never received row %s", s.id)
		}
		beyond[i], total[i] = s.consumer-f, s.consumer
	}
	r.Beyond = summarize(beyond)
	if len(spans) > 0 {
		var behind, own, sentAt, read []time.Duration
		for _, s := range samples {
			if sp, ok := spans[s.id]; ok {
				recv := sp.start.Sub(s.sent) // the span's start, on the same host's clock
				behind = append(behind, recv-floor[s.id])
				own = append(own, s.stored-recv)
				if !sp.walSent.IsZero() {
					sentAt = append(sentAt, sp.walSent.Sub(s.sent)-floor[s.id])
					read = append(read, sp.start.Sub(sp.walSent))
				}
			}
		}
		r.Behind, r.Own, r.Sent, r.Read = summarize(behind), summarize(own), summarize(sentAt), summarize(read)
	}
	p99 := summarize(total).P99
	var t tailSplit
	for _, s := range samples {
		if s.consumer <= p99 {
			continue
		}
		f := floor[s.id]
		t.N++
		if s.consumer-f <= time.Millisecond {
			t.Upstream++
		}
		t.ToFloor += f
		t.ToStored += s.stored - f
		t.ToConsumer += s.consumer - s.stored
		if sp, ok := spans[s.id]; ok {
			recv := sp.start.Sub(s.sent)
			t.Traced++
			t.ToReceived += recv - f
			t.ToOwn += s.stored - recv
			if !sp.walSent.IsZero() {
				t.SentKnown++
				t.ToRead += sp.start.Sub(sp.walSent)
			}
		}
	}
	if t.N > 0 {
		t.ToFloor /= time.Duration(t.N)
		t.ToStored /= time.Duration(t.N)
		t.ToConsumer /= time.Duration(t.N)
	}
	if t.Traced > 0 {
		t.ToReceived /= time.Duration(t.Traced)
		t.ToOwn /= time.Duration(t.Traced)
	}
	if t.SentKnown > 0 {
		t.ToRead /= time.Duration(t.SentKnown)
	}
	r.Tail = t
	return nil
}

// warmUp sends one message per writer (connections and prepared statements
// ready) and drops their latencies.
func (l *steadyLoad) warmUp(ctx context.Context) error {
	for w := range l.b.cfg.Writers {
		if err := l.send(ctx, w, timedPayload(time.Now(), l.shape.size(l.b))); err != nil {
			return err
		}
	}
	l.sent += l.b.cfg.Writers * l.shape.rows()
	err := l.consumer.waitCount(ctx, l.sent, l.b.cfg.Timeout)
	l.consumer.take()
	if err == nil && l.floor != nil {
		err = l.floor.waitCount(ctx, l.sent, l.b.cfg.Timeout)
		l.floor.take()
	}
	if l.spans != nil {
		l.spans.take(ctx, nil, 0) // later ones are ignored: no sample has their id
	}
	return err
}

// produce calls send at rate per second for d, spread over cfg.Writers
// concurrent writers, each send stamped with its own send time in a payload
// of size bytes. It returns
// how many were sent and how long that took (to the end of the last send).
func (b *bench) produce(ctx context.Context, rate int, d time.Duration, send sender, size int) (int, time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	tokens := make(chan struct{}, 4*b.cfg.Writers)
	var sent atomic.Int64
	var wg sync.WaitGroup
	for w := range b.cfg.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range tokens {
				if err := send(ctx, w, timedPayload(time.Now(), size)); err != nil {
					cancel(err)
					return
				}
				sent.Add(1)
			}
		}()
	}
	start := time.Now()
	err := pace(ctx, start, rate, int(float64(rate)*d.Seconds()), tokens)
	close(tokens)
	wg.Wait()
	elapsed := time.Since(start)
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		err = fmt.Errorf("send: %w", cause)
	}
	return int(sent.Load()), elapsed, err
}

// pace hands out total tokens, the i-th due at start + i/rate; it blocks
// while the writers are all busy (the achieved rate then shows it).
func pace(ctx context.Context, start time.Time, rate, total int, tokens chan<- struct{}) error {
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for issued := 0; issued < total; {
		due := min(total, int(time.Since(start).Seconds()*float64(rate))+1)
		for ; issued < due; issued++ {
			select {
			case tokens <- struct{}{}:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	return nil
}

// steadyInsert is one row in its own transaction.
const steadyInsert = `INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'OrderPlaced', $2::jsonb)`

// sqlWriters are the producer's connections to one outbox database.
type sqlWriters []*pgx.Conn

// openWriters connects cfg.Writers producers to database db.
func (b *bench) openWriters(ctx context.Context, db string) (sqlWriters, error) {
	ws := make(sqlWriters, 0, b.cfg.Writers)
	for range b.cfg.Writers {
		c, err := pgx.Connect(ctx, b.srv.dsn(db))
		if err != nil {
			ws.close()
			return nil, fmt.Errorf("connect writer to %s: %w", db, err)
		}
		ws = append(ws, c)
	}
	return ws, nil
}

func (ws sqlWriters) close() {
	for _, c := range ws {
		c.Close(context.Background())
	}
}

// send commits one outbox row from writer w.
func (ws sqlWriters) send(ctx context.Context, w int, payload []byte) error {
	if _, err := ws[w].Exec(ctx, steadyInsert, strconv.Itoa(w), payload); err != nil {
		return fmt.Errorf("insert from writer %d: %w", w, err)
	}
	return nil
}

// sweep is one jetbox set-up's steady-state run and knee search, with the
// latency floor measured on the same rows.
type sweep struct {
	Name      string
	Runs      []latencyRun // the steady run at cfg.SteadyRate, then one per knee step
	Knee      int          // latency flat (p99 ≤ --knee-p99) up to this rate; 0: not even at the steady rate
	Sustained int          // the highest rate kept without a growing backlog
	Check     error        // the stream after the sweep (and the start-ups): every row once, in commit order
}

// add records run and reports whether the sweep goes on (the rate was
// sustained).
func (s *sweep) add(run latencyRun, kneeP99 time.Duration) bool {
	flat := run.flat(kneeP99) && (len(s.Runs) == 0 || s.Knee == s.Runs[len(s.Runs)-1].Rate)
	s.Runs = append(s.Runs, run)
	if flat {
		s.Knee = run.Rate
	}
	if run.sustains() {
		s.Sustained = run.Rate
	}
	return run.sustains()
}

// steadySetups are the jetbox set-ups swept, by workload name.
var steadySetups = []struct {
	workload, name, db, delivery string
	env                          []string
}{
	{"steady", "jetbox, --delivery=dedup", "steady", "dedup", nil},
	{"steady-exactly", "jetbox, --delivery=exactly-once", "steadyeo", "exactly-once", nil},
	{"steady-atomic", "jetbox, exactly-once --atomic-transactions", "steadyatomic", "exactly-once", []string{"JETBOX_ATOMIC_TRANSACTIONS=true"}},
}

// jetboxSweep runs jetbox (delivery, env) at cfg.SteadyRate for cfg.Steady,
// then steps through cfg.Rates until a step no longer keeps up (the knee),
// with the latency floor streaming the same rows beside it. With startups
// it then times warm-slot start-ups (into rep). Finally it checks the
// stream: every row once, in commit order.
func (b *bench) jetboxSweep(ctx context.Context, rep *Report, name, db, delivery string, env []string, startups bool) *sweep {
	sw := &sweep{Name: name}
	d := newDeployment(db, delivery)
	fail := func(err error) *sweep {
		sw.Runs = append(sw.Runs, latencyRun{Name: name, Rate: b.cfg.SteadyRate, Err: err})
		return sw
	}
	var spans *otlpReceiver
	if b.cfg.Trace { // jetbox's publish spans, row by row, to split the tail further
		var err error
		if spans, err = startOTLPReceiver(true); err != nil {
			return fail(err)
		}
		defer spans.close()
		env = append(slices.Clone(env), spans.env()...)
	}
	start := func() (*process, error) { return b.startJetbox(d, env...) }
	if err := b.primeWith(ctx, d, decoder.OutboxDDL, start); err != nil {
		return fail(fmt.Errorf("prime: %w", err))
	}
	ws, err := b.openWriters(ctx, d.db)
	if err != nil {
		return fail(err)
	}
	defer ws.close()
	load, stop, err := b.startSQLLoad(ctx, d, ws, start, loadOpts{streams: true, floor: true})
	if err != nil {
		return fail(err)
	}
	defer load.consumer.stop()
	defer load.floor.stop()
	load.slot, load.spans = d.slot, spans
	if sw.add(load.step(ctx, name, b.cfg.SteadyRate, b.cfg.Steady), b.cfg.KneeP99) {
		for _, rate := range b.cfg.Rates {
			if ctx.Err() != nil || !sw.add(load.step(ctx, name, rate, b.cfg.Step), b.cfg.KneeP99) {
				break
			}
		}
	}
	load.floor.stop()
	if err := stop(); err != nil {
		sw.Check = err
		return sw
	}
	if startups {
		rep.Startups, rep.StartErr = b.startups(ctx, d, ws, load)
	}
	sw.Check = b.verify(ctx, d.db, d.stream, true)
	return sw
}

// loadOpts are startSQLLoad's choices: wait until jetbox streams, measure
// the latency floor beside it, what each send commits, and the sender
// (nil: the writers' 1-row send).
type loadOpts struct {
	streams, floor bool
	shape          loadShape
	send           sender
}

// startSQLLoad starts a forwarder with start (waiting until jetbox streams,
// with opts.streams) and a latency consumer on d's stream, and warms up
// the writers. stop ends the forwarder.
func (b *bench) startSQLLoad(ctx context.Context, d deployment, ws sqlWriters, start func() (*process, error), opts loadOpts) (*steadyLoad, func() error, error) {
	p, err := start()
	if err != nil {
		return nil, nil, err
	}
	stop := func() error {
		if err := p.stop(30 * time.Second); err != nil {
			return fmt.Errorf("%w; log:\n%s", err, p.logTail(2048))
		}
		return nil
	}
	if opts.streams {
		if err := b.waitStreaming(ctx, p, d.slot); err != nil {
			p.kill()
			return nil, nil, err
		}
	}
	c, err := b.startLatencyConsumer(ctx, d.stream)
	if err != nil {
		p.kill()
		return nil, nil, err
	}
	n, err := b.streamMsgs(ctx, d.stream)
	if err != nil {
		c.stop()
		p.kill()
		return nil, nil, err
	}
	load := &steadyLoad{b: b, fwd: p, consumer: c, send: opts.send, base: n, shape: opts.shape}
	if load.send == nil {
		load.send = ws.send
	}
	if opts.floor { // a logical forwarder: measure the floor beside it
		if load.floor, err = b.startFloor(ctx, d.db, "jetbox"); err != nil {
			c.stop()
			p.kill()
			return nil, nil, err
		}
	}
	if err := load.warmUp(ctx); err != nil {
		load.floor.stop()
		c.stop()
		p.kill()
		return nil, nil, fmt.Errorf("warm up: %w", err)
	}
	return load, stop, nil
}

// startups times jetbox's start on a warm slot: with one row committed while
// it was stopped, from exec to that row stored in the stream.
func (b *bench) startups(ctx context.Context, d deployment, ws sqlWriters, load *steadyLoad) ([]time.Duration, error) {
	var out []time.Duration
	for range b.cfg.Starts {
		if err := ws.send(ctx, 0, timedPayload(time.Now(), b.cfg.PayloadSize)); err != nil {
			return out, err
		}
		load.sent++
		p, err := b.startJetbox(d)
		if err != nil {
			return out, err
		}
		if _, err := b.waitStored(ctx, d.stream, load.total(), p); err != nil {
			p.kill()
			return out, err
		}
		_, stored, err := b.storedSpan(ctx, d.stream, load.total(), load.total())
		if err != nil {
			p.kill()
			return out, err
		}
		out = append(out, stored.Sub(p.started))
		if err := stopJetbox(p); err != nil {
			return out, err
		}
	}
	return out, nil
}

// relaySteady runs the polling relay at cfg.SteadyRate for cfg.Steady, on
// the relay's table and stream from its catch-up.
func (b *bench) relaySteady(ctx context.Context) *latencyRun {
	d := relayDeployment
	ws, err := b.openWriters(ctx, d.db)
	if err != nil {
		return &latencyRun{Name: "polling relay", Rate: b.cfg.SteadyRate, Err: err}
	}
	defer ws.close()
	load, stop, err := b.startSQLLoad(ctx, d, ws, func() (*process, error) { return b.startRelay(d) }, loadOpts{})
	if err != nil {
		return &latencyRun{Name: "polling relay", Rate: b.cfg.SteadyRate, Err: err}
	}
	defer load.consumer.stop()
	run := load.step(ctx, "polling relay", b.cfg.SteadyRate, b.cfg.Steady)
	if err := stop(); err != nil && run.Err == nil {
		run.Err = err
	}
	if run.Err == nil {
		run.Err = b.verifyRelay(ctx, d)
	}
	return &run
}

// rawSteady is the floor: messages published straight to JetStream (one
// synchronous publish per message per writer) → the same kind of consumer.
func (b *bench) rawSteady(ctx context.Context) *latencyRun {
	const stream, prefix = "RAWLAT", "rawlat"
	name := "raw JetStream publish → consumer"
	if err := b.createStream(ctx, stream, prefix, false); err != nil {
		return &latencyRun{Name: name, Rate: b.cfg.SteadyRate, Err: err}
	}
	c, err := b.startLatencyConsumer(ctx, stream)
	if err != nil {
		return &latencyRun{Name: name, Rate: b.cfg.SteadyRate, Err: err}
	}
	defer c.stop()
	send := func(ctx context.Context, w int, payload []byte) error {
		_, err := b.srv.js.PublishMsg(ctx, &nats.Msg{Subject: prefix + ".order.OrderPlaced", Data: payload})
		return err
	}
	load := &steadyLoad{b: b, consumer: c, send: send}
	if err := load.warmUp(ctx); err != nil {
		return &latencyRun{Name: name, Rate: b.cfg.SteadyRate, Err: err}
	}
	run := load.step(ctx, name, b.cfg.SteadyRate, b.cfg.Step)
	return &run
}
