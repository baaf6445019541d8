package decoder

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestRowDecoderMatchesDecode: a row read over SQL becomes exactly the event
// (or the invalid-row error, or the dead letter) its pgoutput insert does.
func TestRowDecoderMatchesDecode(t *testing.T) {
	at := time.Date(2026, 12, 1, 10, 0, 0, 123456000, time.UTC)
	rows := [][]*string{
		{s(id1), s("order"), s("42"), s("OrderPlaced"), s(`{"total": 12}`), s(`{"traceparent": "00-ab-cd-01"}`), s("2026-12-01 10:00:00+00")},
		{s(id1), s("order"), s("42"), s("OrderPlaced"), s(`{}`), nil, nil},
		{nil, s("order"), s("1"), s("E"), s("{}"), nil, nil},
		{s(id1), s("order"), s("1"), s("E"), nil, nil, nil},
		{s(id1), s("big order"), s("1"), s("E"), s("{}"), nil, nil},
		{s(id1), s("order"), s("1"), s("E"), s("{}"), s(`[1]`), nil},
		{s(id1), s("order"), s("Nats-Msg-Id"), s("E"), s("{}"), nil, nil},
		{s(id1), s("order"), s("1"), s("E"), s(`{"pad":"` + strings.Repeat("x", 5000) + `"}`), nil, nil},
	}
	for _, dlq := range []string{"", "outbox._dlq"} {
		cfg := Config{Schema: "public", Table: "outbox", Columns: DefaultColumns, SubjectPrefix: "outbox", DeadLetterSubject: dlq, MaxMessageSize: 4096}
		table := make([]TableColumn, len(outboxCols))
		for i, c := range outboxCols {
			table[i] = TableColumn{Name: c.name, TypeOID: c.oid}
		}
		rd := NewRowDecoder(cfg, table)
		for i, row := range rows {
			d := New(cfg)
			decode(t, d, relationMsg(5, "public", "outbox", outboxCols))
			decode(t, d, beginMsg(0xABC, at, 0))
			var want Message
			var wantErr error
			for k := 0; k <= 2; k++ { // the row is the third of its transaction
				want, wantErr = d.Decode(insertMsg(5, row...))
			}
			values := make([][]byte, len(row))
			for j, v := range row {
				if v != nil {
					values[j] = []byte(*v)
				}
			}
			got, gotErr := rd.Decode(values, 0xABC, at, 2)
			if (wantErr == nil) != (gotErr == nil) || (wantErr != nil && wantErr.Error() != gotErr.Error()) {
				t.Fatalf("dlq %q row %d: error %v, pgoutput gives %v", dlq, i, gotErr, wantErr)
			}
			if wantErr == nil {
				want.Event.XID = 0 // a row read over SQL has no transaction id
				if !reflect.DeepEqual(got, want.Event) {
					t.Fatalf("dlq %q row %d:\n got %+v\nwant %+v", dlq, i, got, want.Event)
				}
			}
		}
	}
}
