package audit

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"
)

// escape stands in for the dead letters' id escaping.
func escape(id string) string { return strings.ReplaceAll(id, "Nats-", "Nats_") }

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// scenario is a table and a stream built from fuzz bytes: rows in the
// range (and some out of it), each stored zero, one or more times at a
// commit time within the margin after its key, some as dead letters, some
// foreign ids, stored in an order that mostly follows commit time.
type scenario struct {
	cfg   Config
	rows  []Row                // the range, in (key, id) order
	table map[string]time.Time // every row, in the range or not
	msgs  []Msg
}

func build(data []byte, exactlyOnce bool) scenario {
	b := func(i int) int {
		if len(data) == 0 {
			return 0
		}
		return int(data[i%len(data)])
	}
	const margin = 5
	s := scenario{cfg: Config{Since: t0.Add(10 * time.Second), Until: t0.Add(100 * time.Second), Margin: margin * time.Second,
		ExactlyOnce: exactlyOnce, Batch: 1 + b(0)%4, MaxMissing: 1 << 20, First: 3, Escape: escape}, table: map[string]time.Time{}}
	n := len(data)
	type stored struct {
		m     Msg
		order int
	}
	var st []stored
	for i := 0; i < n; i++ {
		v := b(i)
		key := t0.Add(time.Duration(v%110) * time.Second)
		id := fmt.Sprintf("r%03d", i)
		if v%5 == 0 {
			id = "Nats-" + id // a bad id: its dead letters carry it escaped
		}
		s.table[id] = key
		if key.Before(s.cfg.Since) || key.After(s.cfg.Until) {
			// out of the range: in the table only; maybe in the stream
		} else {
			s.rows = append(s.rows, Row{ID: id, Key: key})
		}
		copies := (v / 7) % 3 // 0, 1 or 2
		if v%31 == 0 {
			copies = 0
		}
		for c := 0; c < copies; c++ {
			dt := time.Duration(b(i+c+1)%(margin+1)) * time.Second
			m := Msg{ID: id, Time: key.Add(dt), Writer: "w/1", LSN: uint64(key.Add(dt).Unix()), Index: i}
			if v%13 == 0 || v%5 == 0 {
				m.ID, m.RowID = "dlq-"+id, escape(id)
			}
			order := int(dt/time.Second)*0 + int(key.Add(dt).Unix())*10 + c
			if b(i+c+2)%17 == 0 { // stored late (a replay, a repair)
				order += 400
				if b(i+c+3)%2 == 0 { // a repair: its own position, in table order
					m.Repaired, m.LSN, m.Index = true, 1, i
				}
			}
			if b(i+c+4)%23 == 0 { // after a failover: a new history
				m.Writer, m.LSN = "w/2", m.LSN/2
			}
			st = append(st, stored{m, order})
		}
		if v%11 == 0 { // a foreign id
			ft := t0.Add(time.Duration(b(i+3)%110) * time.Second)
			st = append(st, stored{Msg{ID: fmt.Sprintf("x%03d", i), Time: ft}, int(ft.Unix()) * 10})
		}
	}
	sort.SliceStable(s.rows, func(i, j int) bool {
		if !s.rows[i].Key.Equal(s.rows[j].Key) {
			return s.rows[i].Key.Before(s.rows[j].Key)
		}
		return s.rows[i].ID < s.rows[j].ID
	})
	sort.SliceStable(st, func(i, j int) bool { return st[i].order < st[j].order })
	for i, x := range st {
		x.m.Seq = uint64(i + 1)
		s.msgs = append(s.msgs, x.m)
	}
	return s
}

// brute is the comparison with everything in memory.
func brute(s scenario) Report {
	var r Report
	r.Rows = int64(len(s.rows))
	inRange := map[string]bool{}
	escaped := map[string]string{} // a row of the range by its escaped id
	for _, row := range s.rows {
		inRange[row.ID] = true
		escaped[escape(row.ID)] = row.ID
	}
	seen := map[string]bool{}
	last := map[string]pos{}
	for _, m := range s.msgs {
		if m.Time.Before(s.cfg.Since) || m.Time.After(s.cfg.Until.Add(s.cfg.Margin)) {
			continue
		}
		r.Messages++
		back := false
		if m.Writer != "" && !m.Repaired {
			p := pos{m.LSN, m.Index}
			if l, ok := last[m.Writer]; ok && (p.lsn < l.lsn || (p.lsn == l.lsn && p.index <= l.index)) {
				back = true
			} else {
				last[m.Writer] = p
			}
		}
		id, dead := m.ID, m.RowID != ""
		if dead {
			id = m.RowID
			if r, ok := escaped[id]; ok {
				id = r
			}
		}
		_, inTable := s.table[id]
		switch {
		case inRange[id] && !seen[id]:
			seen[id] = true
			if dead {
				r.DeadLettered.Count++
			}
			if back {
				r.OutOfOrder.Count++
			}
		case m.Time.After(s.cfg.Until):
		case inRange[id]:
			r.Duplicated.Count++
			if back && s.cfg.ExactlyOnce {
				r.OutOfOrder.Count++
			}
		case inTable:
		default:
			r.NotInTable.Count++
			if back {
				r.OutOfOrder.Count++
			}
		}
	}
	for _, row := range s.rows {
		if !seen[row.ID] {
			r.Missing.Count++
		}
	}
	return r
}

func windowed(t testing.TB, s scenario) Report {
	i := 0
	next := func(context.Context) (Row, bool, error) {
		if i == len(s.rows) {
			return Row{}, false, nil
		}
		i++
		return s.rows[i-1], true, nil
	}
	lookup := func(_ context.Context, ids []string) (map[string]time.Time, error) {
		out := map[string]time.Time{}
		for _, id := range ids {
			if k, ok := s.table[id]; ok {
				out[id] = k
			}
		}
		return out, nil
	}
	a := New(s.cfg, next, lookup)
	ctx := context.Background()
	for _, m := range s.msgs {
		if err := a.Msg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	r, err := a.Finish(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func check(t *testing.T, data []byte) {
	for _, eo := range []bool{true, false} {
		s := build(data, eo)
		want, got := brute(s), windowed(t, s)
		type counts struct{ rows, msgs, miss, dead, dup, ooo, nit int64 }
		c := func(r Report) counts {
			return counts{r.Rows, r.Messages, r.Missing.Count, r.DeadLettered.Count, r.Duplicated.Count, r.OutOfOrder.Count, r.NotInTable.Count}
		}
		if c(want) != c(got) {
			t.Fatalf("exactly-once %v: windowed %+v, brute force %+v", eo, c(got), c(want))
		}
		if int64(len(got.Missing.First)) != min(got.Missing.Count, 3) {
			t.Fatalf("%d missing examples for %d missing", len(got.Missing.First), got.Missing.Count)
		}
		for _, e := range got.Missing.First {
			if _, ok := s.table[e.ID]; !ok {
				t.Fatalf("missing example %s is no row", e.ID)
			}
		}
	}
}

// FuzzWindow compares the windowed audit with a brute-force comparison
// holding everything in memory.
func FuzzWindow(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{7, 14, 21, 28, 35})
	f.Add([]byte("a clean stream, then a gap, a copy and a foreign id"))
	f.Add([]byte{0, 13, 26, 31, 62, 11, 22, 17, 34, 200, 201, 202, 109, 110, 9})
	seed := make([]byte, 512)
	for i := range seed {
		seed[i] = byte(i*37 + i/3)
	}
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 2000 {
			return
		}
		check(t, data)
	})
}

// TestWindowBounded: a million rows in order, each stored once, hold no
// more than one margin of rows at a time.
func TestWindowBounded(t *testing.T) {
	n := 1_000_000
	if testing.Short() {
		n = 100_000
	}
	cfg := Config{Since: t0, Until: t0.Add(time.Duration(n) * time.Millisecond), Margin: time.Second, ExactlyOnce: true}
	i, peak := 0, 0
	var a *Auditor
	next := func(context.Context) (Row, bool, error) {
		if i == n {
			return Row{}, false, nil
		}
		i++
		peak = max(peak, len(a.pending))
		return Row{ID: fmt.Sprint(i), Key: t0.Add(time.Duration(i) * time.Millisecond)}, true, nil
	}
	a = New(cfg, next, func(context.Context, []string) (map[string]time.Time, error) { return nil, nil })
	ctx := context.Background()
	for j := 1; j <= n; j++ {
		if j == 500 {
			continue // one gap
		}
		if err := a.Msg(ctx, Msg{Seq: uint64(j), ID: fmt.Sprint(j), Time: t0.Add(time.Duration(j) * time.Millisecond), Writer: "w", LSN: uint64(j)}); err != nil {
			t.Fatal(err)
		}
	}
	r, err := a.Finish(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Missing.Count != 1 || r.Missing.First[0].ID != "500" || r.Duplicated.Count+r.OutOfOrder.Count+r.NotInTable.Count != 0 {
		t.Fatalf("report %+v", r)
	}
	if peak > 2 || len(a.order) > 10_000 {
		t.Fatalf("held %d rows at once, queue %d", peak, len(a.order))
	}
}
