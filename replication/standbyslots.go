package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/internal/wait"
	"github.com/rs/zerolog"
)

// What --wait-for-standby-slots does once a transaction has waited
// --standby-slot-timeout for the standbys (--on-standby-slot-timeout).
const (
	// StandbySlotWait keeps waiting (warning): nothing is published that a
	// promoted standby may lack.
	StandbySlotWait = "wait"
	// StandbySlotPublish publishes without the guarantee until the slots
	// have caught up again.
	StandbySlotPublish = "publish"
)

// DefaultStandbySlotTimeout is how long a transaction waits for the
// standbys' slots before jetbox warns (and, with StandbySlotPublish, goes
// on without them): longer than a standby's restart or a reconnect, well
// below wal_sender_timeout's default (60 s) after which the primary itself
// drops a silent standby.
const DefaultStandbySlotTimeout = 30 * time.Second

// Poll intervals of the standby slot gate while a transaction waits: the
// first read is at once, then the interval grows to at most the maximum.
// Nothing is polled while no transaction waits.
const (
	standbyPollMin = time.Millisecond
	standbyPollMax = 25 * time.Millisecond
	// unguardedRecheck: while publishing without the guarantee, how often a
	// transaction reads whether the slots have caught up.
	unguardedRecheck = time.Second
	// maxTargets bounds the walsender positions the gate remembers; past it
	// the newest replaces the last (later targets only wait longer).
	maxTargets = 32
)

// StandbySlotsConfig is the --wait-for-standby-slots part of Config.
type StandbySlotsConfig struct {
	// Slots are the physical replication slots of the standbys that must
	// have flushed a transaction before jetbox publishes it; none: off.
	Slots []string
	// Timeout: a transaction waiting longer warns (log, metric, /readyz).
	Timeout time.Duration
	// OnTimeout is StandbySlotWait (default) or StandbySlotPublish.
	OnTimeout string
}

// StandbySlotState is what /readyz shows of the gate (Streamer.StandbySlots).
type StandbySlotState struct {
	// Waiting: a transaction has waited longer than the timeout since
	// WaitingSince; publishing is held back (OnTimeout wait).
	Waiting      bool
	WaitingSince time.Time
	// Unguarded: jetbox publishes without the guarantee (OnTimeout publish).
	Unguarded bool
	// Behind says, per slot, why it holds the transaction back.
	Behind []string
}

// slotPos is one named slot's row, as the gate reads it.
type slotPos struct {
	name          string
	exists, phys  bool
	active        bool
	flush         pglogrepl.LSN // restart_lsn: the standby's last reported flush; 0 when NULL
	lag           int64         // the primary's flush position minus flush, bytes
	invalidReason string        // wal_status lost
}

// slotReading is one poll: the session's walsender's position and the
// named slots' positions.
type slotReading struct {
	// sent is the walsender's sent_lsn: the end of the last WAL record it
	// decoded. Every transaction whose commit record starts before it was
	// decoded whole, so its commit record ends at or before it.
	sent  pglogrepl.LSN
	slots []slotPos
}

// slotReader reads the positions (a regular connection to the primary).
type slotReader interface {
	read(ctx context.Context) (slotReading, error)
	close()
}

// standbyGate holds back each transaction until every named physical slot
// has flushed its commit record: restart_lsn of a physical slot is the
// flush position its standby last reported (walsender.c
// PhysicalConfirmReceivedLocation), which PostgreSQL 17's
// synchronized_standby_slots waits on too (slot.c StandbySlotsHaveCaughtup).
// A transaction is known only by where its commit record starts
// (Event.CommitLSN), not where it ends: the gate waits for a slot flush at
// or past a walsender position (sent_lsn) read above that start, which lies
// at or past the record's end. Owned by the loop's goroutine.
type standbyGate struct {
	cfg     StandbySlotsConfig
	r       slotReader
	log     zerolog.Logger
	metrics *metrics.Metrics
	state   *atomic.Pointer[StandbySlotState]
	now     func() time.Time
	sleep   func(ctx context.Context, d time.Duration) error

	safe    pglogrepl.LSN   // a transaction whose commit starts before safe is flushed by every slot
	targets []pglogrepl.LSN // walsender positions read, increasing, above safe
	behind  []string        // the last reading's lagging slots, described

	unguarded bool      // publishing without the guarantee (OnTimeout publish)
	lastRead  time.Time // while unguarded: when the slots were last read
}

// pass returns once the transaction whose commit record starts at commit
// may be published: every slot flushed it, or (OnTimeout publish) it has
// waited the timeout. keep runs while it waits (standby status to the
// logical walsender, the monitor's stop signals); its error ends the wait.
func (g *standbyGate) pass(ctx context.Context, commit pglogrepl.LSN, keep func() error) error {
	if g == nil || commit < g.safe {
		return nil
	}
	if g.unguarded {
		return g.recheck(ctx, commit)
	}
	start := g.now()
	poll := standbyPollMin
	warned := false
	for {
		if err := g.poll(ctx); err != nil {
			return err
		}
		if commit < g.safe {
			g.metrics.StandbySlotWait.Observe(g.now().Sub(start).Seconds())
			if warned {
				g.log.Info().Str("lsn", commit.String()).Stringer("waited", g.now().Sub(start).Round(time.Millisecond)).
					Msg("the standbys' slots (--wait-for-standby-slots) flushed the transaction: publishing again")
			}
			if st := g.state.Load(); st != nil && st.Waiting {
				g.setState(StandbySlotState{}) // also a wait an earlier session began
			}
			return nil
		}
		if waited := g.now().Sub(start); waited >= g.cfg.Timeout && !warned {
			warned = true
			if g.cfg.OnTimeout == StandbySlotPublish {
				g.log.Warn().Str("lsn", commit.String()).Strs("behind", g.behind).Stringer("waited", waited.Round(time.Millisecond)).
					Msg("--wait-for-standby-slots: the standbys have not flushed this transaction within --standby-slot-timeout; publishing WITHOUT the guarantee (--on-standby-slot-timeout=publish) until they catch up: a failover now may leave events in the stream whose rows the promoted standby lacks")
				g.unguarded, g.lastRead = true, g.now()
				g.setState(StandbySlotState{Unguarded: true, Behind: g.behind})
				g.metrics.StandbySlotWait.Observe(waited.Seconds())
				return nil
			}
			g.log.Warn().Str("lsn", commit.String()).Strs("behind", g.behind).Stringer("waited", waited.Round(time.Millisecond)).
				Msg("--wait-for-standby-slots: the standbys have not flushed this transaction within --standby-slot-timeout; publishing waits for them (--on-standby-slot-timeout=wait): bring the standby back, or drop its slot from --wait-for-standby-slots")
			g.setState(StandbySlotState{Waiting: true, WaitingSince: start, Behind: g.behind})
		} else if warned {
			st := *g.state.Load()
			st.Behind = g.behind
			g.setState(st)
		}
		if err := keep(); err != nil {
			return err
		}
		if err := g.sleep(ctx, poll); err != nil {
			return err
		}
		poll = min(poll*3/2+time.Millisecond/2, standbyPollMax)
	}
}

// recheck is pass while publishing without the guarantee: it reads the
// slots at most every unguardedRecheck, and guards again once they have
// flushed the transaction.
func (g *standbyGate) recheck(ctx context.Context, commit pglogrepl.LSN) error {
	if g.now().Sub(g.lastRead) < unguardedRecheck {
		return nil
	}
	g.lastRead = g.now()
	if err := g.poll(ctx); err != nil {
		return err
	}
	if commit < g.safe {
		g.unguarded = false
		g.setState(StandbySlotState{})
		g.log.Info().Str("lsn", commit.String()).Msg("the standbys' slots (--wait-for-standby-slots) caught up: publishing with the guarantee again")
		return nil
	}
	st := *g.state.Load()
	st.Behind = g.behind
	g.setState(st)
	return nil
}

// poll reads the positions once and advances safe: past every walsender
// position that every slot's flush has reached.
func (g *standbyGate) poll(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rd, err := g.r.read(qctx)
	if err != nil {
		return err
	}
	if rd.sent != 0 && (len(g.targets) == 0 || rd.sent > g.targets[len(g.targets)-1]) && rd.sent > g.safe {
		if len(g.targets) == maxTargets {
			g.targets[len(g.targets)-1] = rd.sent
		} else {
			g.targets = append(g.targets, rd.sent)
		}
	}
	flushed := pglogrepl.LSN(1<<64 - 1)
	g.behind = g.behind[:0]
	for _, s := range rd.slots {
		switch {
		case !s.exists:
			flushed = 0
			g.behind = append(g.behind, fmt.Sprintf("slot %q does not exist", s.name))
		case !s.phys:
			flushed = 0
			g.behind = append(g.behind, fmt.Sprintf("slot %q is a logical slot, not a standby's", s.name))
		default:
			g.metrics.StandbySlotLag.WithLabelValues(s.name).Set(float64(s.lag))
			flushed = min(flushed, s.flush)
			if len(g.targets) > 0 && s.flush < g.targets[0] {
				g.behind = append(g.behind, s.describe())
			}
		}
	}
	i := 0
	for i < len(g.targets) && g.targets[i] <= flushed {
		g.safe = g.targets[i]
		i++
	}
	g.targets = g.targets[:copy(g.targets, g.targets[i:])]
	return nil
}

// describe says how far behind a slot is, and whether a standby streams.
func (s slotPos) describe() string {
	d := fmt.Sprintf("slot %q flushed %s, %d bytes behind", s.name, s.flush, s.lag)
	switch {
	case s.invalidReason != "":
		d += " (invalidated: " + s.invalidReason + ")"
	case !s.active:
		d += " (no standby streams from it)"
	}
	return d
}

func (g *standbyGate) setState(st StandbySlotState) {
	st.Behind = append([]string(nil), st.Behind...)
	g.state.Store(&st)
	w, u := 0.0, 0.0
	if st.Waiting {
		w = 1
	}
	if st.Unguarded {
		u = 1
	}
	g.metrics.StandbySlotWaiting.Set(w)
	g.metrics.StandbySlotUnguarded.Set(u)
}

func (g *standbyGate) close() {
	if g != nil {
		g.r.close()
	}
}

// openStandbyGate connects to the primary for the gate of the session
// whose walsender is pid. It returns nil when no slots are named.
func (s *Streamer) openStandbyGate(ctx context.Context, pid uint32) (*standbyGate, error) {
	if len(s.cfg.StandbySlots.Slots) == 0 {
		return nil, nil
	}
	conn, err := connect(ctx, s.connString)
	if err != nil {
		return nil, fmt.Errorf("connect to read the standbys' slots (--wait-for-standby-slots): %w", err)
	}
	g := &standbyGate{cfg: s.cfg.StandbySlots, r: &pgSlotReader{conn: conn, slots: s.cfg.StandbySlots.Slots, pid: pid},
		log: s.log, metrics: s.cfg.Metrics, state: &s.standbySlots, now: time.Now, sleep: wait.Sleep}
	if st := s.standbySlots.Load(); st != nil && st.Unguarded {
		g.unguarded = true // still behind since the last session: recheck at once
	}
	return g, nil
}

// WaitStandbySlotsPast waits until every slot of cfg.StandbySlots has
// flushed past lsn, with the gate's timeout rules (cfg.StandbySlots): a
// repair waits for its snapshot's consistent point, before which every row
// it publishes committed, so that a promoted standby holds every row the
// repair published. It returns at once when no slot is named.
func WaitStandbySlotsPast(ctx context.Context, connString string, cfg Config, lsn pglogrepl.LSN, log zerolog.Logger) error {
	if len(cfg.StandbySlots.Slots) == 0 || lsn == 0 {
		return nil
	}
	conn, err := connect(ctx, connString)
	if err != nil {
		return fmt.Errorf("connect to read the standbys' slots (--wait-for-standby-slots): %w", err)
	}
	r := &pgSlotReader{conn: conn, slots: cfg.StandbySlots.Slots, at: lsn}
	defer r.close()
	m := cfg.Metrics
	if m == nil {
		m = metrics.New()
	}
	var state atomic.Pointer[StandbySlotState]
	g := &standbyGate{cfg: cfg.StandbySlots, r: r, log: log, metrics: m, state: &state, now: time.Now, sleep: wait.Sleep}
	return g.pass(ctx, lsn-1, func() error { return nil })
}

// StandbySlots returns the state of --wait-for-standby-slots' gate (zero
// while it holds nothing back, or is off).
func (s *Streamer) StandbySlots() StandbySlotState {
	if st := s.standbySlots.Load(); st != nil {
		return *st
	}
	return StandbySlotState{}
}

// pgSlotReader reads the positions from pg_stat_replication (the session's
// walsender) and pg_replication_slots (the named slots).
type pgSlotReader struct {
	conn  *pgx.Conn
	slots []string
	pid   uint32
	// at, with pid 0: the position to wait for instead of a walsender's
	// (WaitStandbySlotsPast).
	at pglogrepl.LSN
}

// standbySlotsSQL reads the walsender's sent_lsn and, per named slot (in
// order), its type, whether a standby streams from it, restart_lsn and the
// lag behind the primary's flush position.
const standbySlotsSQL = `SELECT (SELECT sent_lsn::text FROM pg_stat_replication WHERE pid = $2),
	EXISTS (SELECT 1 FROM pg_stat_replication WHERE pid = $2), n.name,
	s.slot_name IS NOT NULL, coalesce(s.slot_type = 'physical', false), coalesce(s.active, false),
	coalesce(s.restart_lsn, '0/0')::text, coalesce(pg_wal_lsn_diff(pg_current_wal_flush_lsn(), s.restart_lsn), 0)::bigint,
	CASE WHEN s.wal_status = 'lost' THEN 'wal_removed' ELSE '' END
	FROM unnest($1::text[]) WITH ORDINALITY AS n(name, i) LEFT JOIN pg_replication_slots s ON s.slot_name = n.name ORDER BY n.i`

func (r *pgSlotReader) read(ctx context.Context) (slotReading, error) {
	rows, err := r.conn.Query(ctx, standbySlotsSQL, r.slots, int64(r.pid))
	if err != nil {
		return slotReading{}, fmt.Errorf("read the standbys' slots (--wait-for-standby-slots): %w", err)
	}
	var rd slotReading
	var sent *string
	var found bool
	for rows.Next() {
		var p slotPos
		var flush string
		if err := rows.Scan(&sent, &found, &p.name, &p.exists, &p.phys, &p.active, &flush, &p.lag, &p.invalidReason); err != nil {
			rows.Close()
			return slotReading{}, fmt.Errorf("read the standbys' slots (--wait-for-standby-slots): %w", err)
		}
		if p.flush, err = pglogrepl.ParseLSN(flush); err != nil {
			rows.Close()
			return slotReading{}, fmt.Errorf("parse restart_lsn of slot %q: %w", p.name, err)
		}
		rd.slots = append(rd.slots, p)
	}
	if err := rows.Err(); err != nil {
		return slotReading{}, fmt.Errorf("read the standbys' slots (--wait-for-standby-slots): %w", err)
	}
	if r.pid == 0 {
		rd.sent = r.at
		return rd, nil
	}
	if sent == nil {
		if !found {
			// Another server than the walsender's (a multi-host URL during
			// a failover), or the walsender is gone: a new session.
			return slotReading{}, fmt.Errorf("--wait-for-standby-slots: no walsender with pid %d on the server the slots are read from", r.pid)
		}
		return slotReading{}, &PermanentError{Err: fmt.Errorf("--wait-for-standby-slots: pg_stat_replication shows this role no sent_lsn of jetbox's walsender (pid %d)", r.pid),
			Hint: "GRANT pg_read_all_stats TO the role of --postgres-url (PostgreSQL shows walsender positions only to roles with its privileges)"}
	}
	if rd.sent, err = pglogrepl.ParseLSN(*sent); err != nil {
		return slotReading{}, fmt.Errorf("parse sent_lsn: %w", err)
	}
	return rd, nil
}

func (r *pgSlotReader) close() { _ = r.conn.Close(context.Background()) }

// ParseStandbySlots splits --wait-for-standby-slots: comma-separated slot
// names, each a valid replication slot name, none twice.
func ParseStandbySlots(v string) ([]string, error) {
	var names []string
	var errs []error
	seen := map[string]bool{}
	for _, n := range strings.Split(v, ",") {
		n = strings.TrimSpace(n)
		switch {
		case n == "":
		case !validSlotName(n):
			errs = append(errs, fmt.Errorf("%q is not a replication slot name (lower-case letters, digits and _, at most 63)", n))
		case seen[n]:
			errs = append(errs, fmt.Errorf("%q is named twice", n))
		default:
			seen[n] = true
			names = append(names, n)
		}
	}
	return names, errors.Join(errs...)
}

func validSlotName(n string) bool {
	if len(n) == 0 || len(n) > 63 {
		return false
	}
	for _, r := range n {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
			return false
		}
	}
	return true
}
