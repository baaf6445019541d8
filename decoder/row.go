package decoder

import (
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
)

// RowDecoder turns outbox rows read over SQL (jetbox repair) into events
// with exactly the rules Decode applies to pgoutput inserts: the same column
// checks, subject, headers, payload forms, invalid-row reasons and dead
// letters. It is pure and not safe for concurrent use.
type RowDecoder struct {
	cfg Config
	rel *relation
}

// NewRowDecoder returns a decoder for rows whose values come in the order
// of cols (name and type OID, as pgoutput's Relation message lists them,
// with domains resolved to their base types: see Domains.BaseType).
func NewRowDecoder(cfg Config, cols []TableColumn) *RowDecoder {
	m := &pglogrepl.RelationMessage{Namespace: cfg.Schema, RelationName: cfg.Table, ColumnNum: uint16(len(cols))}
	for _, c := range cols {
		m.Columns = append(m.Columns, &pglogrepl.RelationMessageColumn{Name: c.Name, DataType: c.TypeOID})
	}
	d := New(cfg)
	return &RowDecoder{cfg: cfg, rel: d.newRelation(m, false)}
}

// Decode builds the event of one row. values are the columns' text output
// (what pgoutput sends: bytea in hex), nil for NULL; they may be reused
// after Decode returns. The event gets the position (commitLSN, txIndex) and
// commit time given. Like Decode, an invalid row is an *InvalidEventError,
// or a dead letter when Config.DeadLetterSubject is set.
func (r *RowDecoder) Decode(values [][]byte, commitLSN pglogrepl.LSN, commitTime time.Time, txIndex int) (Event, error) {
	if len(values) != r.rel.ncols {
		return Event{}, &InvalidEventError{LSN: commitLSN, TxIndex: txIndex, Code: format.ReasonTableChanged,
			Reason: "row has a different number of columns than the table", Hint: "report this as a bug"}
	}
	cols := make([]column, len(values))
	for i, v := range values {
		if v == nil {
			cols[i].kind = 'n'
		} else {
			cols[i] = column{kind: 't', data: v}
		}
	}
	ev := Event{CommitLSN: commitLSN, CommitTime: commitTime.UTC(), TxIndex: txIndex}
	if err := r.rel.fill(&ev, cols, &r.cfg); err != nil {
		err.LSN, err.TxIndex = commitLSN, txIndex
		if r.cfg.DeadLetterSubject == "" || !err.DeadLetterable() {
			return Event{}, err
		}
		return r.cfg.DeadLetter(&ev, err), nil
	}
	return ev, nil
}
