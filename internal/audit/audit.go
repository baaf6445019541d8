// Package audit compares the outbox rows of a range with what the stream
// holds, in one pass over each and with bounded memory (jetbox audit).
//
// The table is read in its order key (key, id) and the stream in its own
// order; each message is matched against the rows whose key is at most its
// commit time and at least its commit time minus the margin (the longest
// transaction: a row's created_at precedes its commit). Rows are read just
// far enough ahead of the stream, and a row that no message matched once
// the stream has passed its key plus the margin is missing. So the rows
// held at once are those of one margin of the order key, plus the missing
// ones (which a later message, stored out of time order, may still match).
// A message whose id matches no row held is looked up in the table in
// batches: a row of the range means a second copy (its first copy matched
// earlier), no row means an id the table does not hold.
package audit

import (
	"context"
	"sort"
	"time"
)

// Row is an outbox row: its id and order key (the commit timestamp, or
// created_at).
type Row struct {
	ID  string
	Key time.Time
}

// Msg is a stream message's headers.
type Msg struct {
	Seq    uint64
	ID     string    // Nats-Msg-Id
	RowID  string    // Jetbox-Row-Id: the message is the row's dead letter
	Time   time.Time // Jetbox-Commit-Time (the stored time when absent)
	Stored time.Time
	// Writer is the Jetbox-Source origin, its timeline included (positions
	// of one history compare; a failover or a restore starts another);
	// "" for a message jetbox did not write (no position).
	Writer string
	LSN    uint64 // Jetbox-Commit-LSN
	Index  int    // Jetbox-Tx-Index
	// Repaired: jetbox repair published it (Jetbox-Repaired), in table
	// order at its own position: not checked for order.
	Repaired bool
}

// Config is one audit's range and mode.
type Config struct {
	Since, Until time.Time // rows with Since <= key <= Until
	// Margin is how long after its key a row's message may commit (the
	// longest transaction; 0 with commit timestamps, where the key is the
	// commit time).
	Margin time.Duration
	// ExactlyOnce: every position going backwards is out of order; else
	// (dedup) only first copies must be in order.
	ExactlyOnce bool
	// MaxMissing bounds the missing ids held for a late match; beyond it
	// they are counted only (Report.Truncated).
	MaxMissing int
	// Batch is how many unmatched messages are looked up at once.
	Batch int
	// First is how many examples of each kind the report keeps.
	First int
	// Escape maps a row's id to its dead letters' Jetbox-Row-Id (ids with
	// control characters or "Nats-" are escaped, long ones cut); nil: as
	// is. The rows whose escaped id differs are held (a few bad ids).
	Escape func(id string) string
}

// RowFunc returns the next row in (key, id) order; ok false at the end.
type RowFunc func(ctx context.Context) (r Row, ok bool, err error)

// LookupFunc returns the order keys of the ids the table holds.
type LookupFunc func(ctx context.Context, ids []string) (map[string]time.Time, error)

// Example is one id found, with its commit time (or key) and sequence.
type Example struct {
	ID   string    `json:"id"`
	Time time.Time `json:"commit_time"`
	Seq  uint64    `json:"seq,omitempty"`
}

// Kind is the count and first examples of one kind of finding.
type Kind struct {
	Count int64     `json:"count"`
	First []Example `json:"first,omitempty"`
}

// Report is an audit's result.
type Report struct {
	Rows         int64 `json:"rows"`
	Messages     int64 `json:"messages"`
	Missing      Kind  `json:"missing"`
	DeadLettered Kind  `json:"dead_lettered"`
	Duplicated   Kind  `json:"duplicated"`
	OutOfOrder   Kind  `json:"out_of_order"`
	NotInTable   Kind  `json:"not_in_table"`
	// Truncated: more than MaxMissing rows were missing at once; a late
	// message may have matched one of those not held, counted missing.
	Truncated bool `json:"truncated,omitempty"`
}

// Found reports whether the audit found a defect (not in the table counts
// only when strict).
func (r *Report) Found(strict bool) bool {
	return r.Missing.Count > 0 || r.Duplicated.Count > 0 || r.OutOfOrder.Count > 0 || (strict && r.NotInTable.Count > 0)
}

type pos struct {
	lsn   uint64
	index int
}

type pending struct {
	key time.Time
	seq int64 // read order, to evict in order
}

// Auditor is one audit in progress: Msg for each message in stream order,
// then Finish.
type Auditor struct {
	cfg    Config
	next   RowFunc
	lookup LookupFunc
	rep    Report

	row     Row
	hasRow  bool
	rowsEnd bool
	read    int64

	pending map[string]pending // rows read, not matched yet, within the margin
	order   []string           // pending ids in read order (a queue)
	head    int
	missing map[string]time.Time
	alias   map[string]string // escaped id -> row id, for the rows whose ids differ
	late    []Msg             // unmatched messages awaiting a lookup
	lateOOO map[uint64]bool   // of those, which went backwards (dedup mode)
	last    map[string]pos
	front   time.Time // the latest message time seen
}

// New starts an audit of the rows next returns against the messages given
// to Msg.
func New(cfg Config, next RowFunc, lookup LookupFunc) *Auditor {
	if cfg.Batch <= 0 {
		cfg.Batch = 1000
	}
	if cfg.First <= 0 {
		cfg.First = 10
	}
	if cfg.MaxMissing <= 0 {
		cfg.MaxMissing = 1_000_000
	}
	return &Auditor{cfg: cfg, next: next, lookup: lookup, pending: map[string]pending{}, missing: map[string]time.Time{},
		alias: map[string]string{}, lateOOO: map[uint64]bool{}, last: map[string]pos{}}
}

func (a *Auditor) add(k *Kind, e Example) {
	k.Count++
	if len(k.First) < a.cfg.First {
		k.First = append(k.First, e)
	}
}

// readRows reads the rows whose key is at or before t into the window.
func (a *Auditor) readRows(ctx context.Context, t time.Time, all bool) error {
	for !a.rowsEnd {
		if !a.hasRow {
			r, ok, err := a.next(ctx)
			if err != nil {
				return err
			}
			if !ok {
				a.rowsEnd = true
				return nil
			}
			a.row, a.hasRow = r, true
		}
		if !all && a.row.Key.After(t) {
			return nil
		}
		a.hasRow = false
		a.rep.Rows++
		a.read++
		a.pending[a.row.ID] = pending{key: a.row.Key, seq: a.read}
		if a.cfg.Escape != nil {
			if e := a.cfg.Escape(a.row.ID); e != a.row.ID {
				a.alias[e] = a.row.ID
			}
		}
		a.order = append(a.order, a.row.ID)
	}
	return nil
}

// evict declares missing the pending rows no message at or before front
// can match any more (key + margin < front).
func (a *Auditor) evict(front time.Time, all bool) {
	for a.head < len(a.order) {
		id := a.order[a.head]
		p, ok := a.pending[id]
		if ok && !all && !p.key.Add(a.cfg.Margin).Before(front) {
			return
		}
		a.order[a.head] = ""
		a.head++
		if !ok {
			continue
		}
		delete(a.pending, id)
		a.rep.Missing.Count++
		if len(a.missing) < a.cfg.MaxMissing {
			a.missing[id] = p.key
		} else {
			a.rep.Truncated = true
		}
	}
	if a.head > 4096 && a.head*2 > len(a.order) { // compact the queue
		a.order = append(a.order[:0], a.order[a.head:]...)
		a.head = 0
	}
}

// Msg takes the stream's next message.
func (a *Auditor) Msg(ctx context.Context, m Msg) error {
	if m.Time.Before(a.cfg.Since) || m.Time.After(a.cfg.Until.Add(a.cfg.Margin)) {
		return nil // out of the range: no row of it can match
	}
	a.rep.Messages++
	if err := a.readRows(ctx, m.Time, false); err != nil {
		return err
	}
	backwards := false
	if m.Writer != "" && !m.Repaired {
		p := pos{m.LSN, m.Index}
		if l, ok := a.last[m.Writer]; ok && (p.lsn < l.lsn || (p.lsn == l.lsn && p.index <= l.index)) {
			backwards = true
		} else {
			a.last[m.Writer] = p
		}
	}
	id, dead := m.ID, false
	if m.RowID != "" {
		id, dead = a.rowID(m.RowID), true
	}
	if _, ok := a.pending[id]; ok {
		delete(a.pending, id)
		a.matched(m, dead, backwards)
	} else if _, ok := a.missing[id]; ok { // stored out of time order
		delete(a.missing, id)
		a.rep.Missing.Count--
		a.matched(m, dead, backwards)
	} else if m.Time.After(a.cfg.Until) {
		// a row after the range's end, or a copy
	} else {
		if backwards {
			a.lateOOO[m.Seq] = true
		}
		a.late = append(a.late, m)
		if len(a.late) >= a.cfg.Batch {
			if err := a.resolve(ctx); err != nil {
				return err
			}
		}
	}
	if m.Time.After(a.front) {
		a.front = m.Time
		a.evict(a.front, false)
	}
	return nil
}

// rowID is the row id a dead letter's Jetbox-Row-Id stands for: a row
// read whose escaped id it is, else itself.
func (a *Auditor) rowID(rowID string) string {
	if id, ok := a.alias[rowID]; ok {
		return id
	}
	return rowID
}

func (a *Auditor) matched(m Msg, dead, backwards bool) {
	id := m.ID
	if dead {
		id = a.rowID(m.RowID)
		a.add(&a.rep.DeadLettered, Example{ID: id, Time: m.Time, Seq: m.Seq})
	}
	if backwards {
		a.add(&a.rep.OutOfOrder, Example{ID: id, Time: m.Time, Seq: m.Seq})
	}
}

// resolve looks up the unmatched messages: a row of the range is a second
// copy, none an id not in the table.
func (a *Auditor) resolve(ctx context.Context) error {
	if len(a.late) == 0 {
		return nil
	}
	ids := make([]string, 0, len(a.late))
	for _, m := range a.late {
		id := m.ID
		if m.RowID != "" {
			id = a.rowID(m.RowID)
		}
		ids = append(ids, id)
	}
	keys, err := a.lookup(ctx, ids)
	if err != nil {
		return err
	}
	for i, m := range a.late {
		k, ok := keys[ids[i]]
		switch {
		case ok && !k.Before(a.cfg.Since) && !k.After(a.cfg.Until):
			a.add(&a.rep.Duplicated, Example{ID: ids[i], Time: m.Time, Seq: m.Seq})
			if a.cfg.ExactlyOnce && a.lateOOO[m.Seq] {
				a.add(&a.rep.OutOfOrder, Example{ID: ids[i], Time: m.Time, Seq: m.Seq})
			}
		case ok: // a row out of the range
		default:
			a.add(&a.rep.NotInTable, Example{ID: ids[i], Time: m.Time, Seq: m.Seq})
			if a.lateOOO[m.Seq] {
				a.add(&a.rep.OutOfOrder, Example{ID: ids[i], Time: m.Time, Seq: m.Seq})
			}
		}
	}
	a.late = a.late[:0]
	clear(a.lateOOO)
	return nil
}

// EndRows reads the rest of the rows and declares missing those no
// message matched yet: the stream has passed the range. Messages may still
// follow (a repair's, stored late), matching rows counted missing.
func (a *Auditor) EndRows(ctx context.Context) error {
	if err := a.readRows(ctx, time.Time{}, true); err != nil {
		return err
	}
	a.evict(time.Time{}, true)
	return nil
}

// Missing is how many rows are missing so far.
func (a *Auditor) Missing() int64 { return a.rep.Missing.Count }

// Finish reads the rest of the rows, decides them and returns the report.
func (a *Auditor) Finish(ctx context.Context) (Report, error) {
	if err := a.resolve(ctx); err != nil {
		return Report{}, err
	}
	if err := a.EndRows(ctx); err != nil {
		return Report{}, err
	}
	ex := make([]Example, 0, len(a.missing))
	for id, k := range a.missing {
		ex = append(ex, Example{ID: id, Time: k})
	}
	sort.Slice(ex, func(i, j int) bool {
		if !ex[i].Time.Equal(ex[j].Time) {
			return ex[i].Time.Before(ex[j].Time)
		}
		return ex[i].ID < ex[j].ID
	})
	a.rep.Missing.First = ex[:min(len(ex), a.cfg.First)]
	return a.rep, nil
}
