package main

// jetbox audit's report: text or JSON, and its exit code.

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/internal/audit"
)

// auditJSON is the --json output: the report and its range.
type auditJSON struct {
	Result string    `json:"result"` // complete or defects
	Since  time.Time `json:"since"`
	Until  time.Time `json:"until"`
	// RequestedUntil is the --until asked for when the range ends earlier,
	// where jetbox has provably published.
	RequestedUntil *time.Time `json:"requested_until,omitempty"`
	// DeletedInStream is how many messages were deleted inside the stream
	// (not from its start): a row whose message was deleted counts as
	// missing.
	DeletedInStream uint64 `json:"deleted_in_stream,omitempty"`
	Order           string `json:"order"`
	Stream          string `json:"stream"`
	audit.Report
}

// report prints the result and returns the exit code.
func (a *auditor) report(rep audit.Report, since time.Time, order string, sr streamRange) (int, error) {
	found := rep.Found(a.s.strict)
	code, result := exitOK, "complete"
	if found {
		code, result = exitFound, "defects"
	}
	if a.s.json {
		enc := json.NewEncoder(a.stdout)
		enc.SetIndent("", "  ")
		j := auditJSON{Result: result, Since: since, Until: a.s.until, Order: order, Stream: a.s.cfg.Sink.Stream, DeletedInStream: sr.deleted, Report: rep}
		if !a.requested.IsZero() {
			j.RequestedUntil = &a.requested
		}
		return code, enc.Encode(j)
	}
	w := a.stdout
	el := time.Since(a.started)
	fmt.Fprintf(w, "range:          %s to %s (order: %s)\n", since.Format(time.RFC3339Nano), a.s.until.Format(time.RFC3339Nano), order)
	if !a.requested.IsZero() {
		fmt.Fprintf(w, "note:           the range ends before --until %s, where jetbox has provably published (its last message's commit time at the start)\n", a.requested.Format(time.RFC3339Nano))
	}
	fmt.Fprintf(w, "rows:           %d\n", rep.Rows)
	fmt.Fprintf(w, "messages:       %d in the range (stream %s, seq %d to %d)\n", rep.Messages, a.s.cfg.Sink.Stream, sr.first, sr.last)
	kind := func(name string, k audit.Kind, defect bool) {
		note := ""
		if !defect && k.Count > 0 {
			note = " (not a defect)"
		}
		fmt.Fprintf(w, "%-15s %d%s\n", name+":", k.Count, note)
		for _, e := range k.First {
			s := "  " + e.ID + " at " + e.Time.UTC().Format(time.RFC3339Nano)
			if e.Seq > 0 {
				s += fmt.Sprintf(" (seq %d)", e.Seq)
			}
			fmt.Fprintln(w, s)
		}
		if k.Count > int64(len(k.First)) && len(k.First) > 0 {
			fmt.Fprintf(w, "  ... %d more\n", k.Count-int64(len(k.First)))
		}
	}
	kind("missing", rep.Missing, true)
	kind("dead-lettered", rep.DeadLettered, false)
	kind("duplicated", rep.Duplicated, true)
	kind("out of order", rep.OutOfOrder, true)
	kind("not in table", rep.NotInTable, a.s.strict)
	if sr.deleted > 0 {
		fmt.Fprintf(w, "note:           %d messages were deleted inside the stream (a delete by hand or by a tool): the rows they carried count as missing\n", sr.deleted)
	}
	if rep.Truncated {
		fmt.Fprintln(w, "note:           more rows were missing at once than the audit holds: some counted missing may be in the stream later")
	}
	if rep.Missing.Count > 0 && len(rep.Missing.First) > 0 {
		fmt.Fprintf(w, "repair:         jetbox repair --since %s   # re-publishes the missing rows (stop jetbox run first; see \"Repair and backfill\" in docs/operations.md)\n",
			rep.Missing.First[0].Time.UTC().Format(time.RFC3339Nano))
	}
	fmt.Fprintf(w, "result:         %s (%d rows, %d messages in %s)\n", result, rep.Rows, rep.Messages, el.Round(time.Millisecond))
	return code, nil
}
