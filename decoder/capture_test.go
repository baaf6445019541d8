package decoder

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// captureWorkloads are transactions whose pgoutput messages seed the fuzz
// corpus: every column type the decoder accepts, NULLs, headers, updates,
// deletes, truncates, rows of other tables and DDL (new Relation messages).
var captureWorkloads = [][]string{
	{`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('order', 'o-1', 'OrderCreated', '{"total": 12.5, "items": [1, 2]}', '{"traceparent": "00-abc-def-01"}')`},
	{`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) SELECT 'order', 'o-' || g, 'Bulk', jsonb_build_object('n', g) FROM generate_series(1, 3) g`,
		`INSERT INTO other (note) VALUES ('not the outbox')`},
	{`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('cust', E'\u00e9t\u00e9', 'Renamed', '"just a string"', '{"a": null, "b": "x"}')`},
	{`UPDATE outbox SET event_type = 'Updated' WHERE aggregate_id = 'o-1'`, `DELETE FROM outbox WHERE aggregate_id = 'o-2'`},
	{`TRUNCATE other`},
	{`ALTER TABLE outbox ADD COLUMN note text`, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, note) VALUES ('order', 'o-9', 'AfterAdd', '{}', 'n')`},
	{`ALTER TABLE outbox ALTER COLUMN payload TYPE text`, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'o-10', 'TextPayload', 'plain text')`},
	{`ALTER TABLE outbox RENAME COLUMN event_type TO kind`, `INSERT INTO outbox (aggregate_type, aggregate_id, kind, payload) VALUES ('order', 'o-11', 'Renamed', '{}')`},
	{`CREATE TABLE bin (id text PRIMARY KEY, body bytea)`, `INSERT INTO bin VALUES ('b', '\x00ff0a5c')`},
}

// captureMessageWorkloads are transactions with logical decoding messages
// (recorded with the messages option on): envelopes as jetbox_emit writes
// them, mixed with rows, a binary payload, a bad envelope, another prefix,
// a non-transactional message and a heartbeat.
var captureMessageWorkloads = [][]string{
	{`INSERT INTO outbox (aggregate_type, aggregate_id, kind, payload) VALUES ('order', 'o-20', 'RowFirst', '{}')`, // kind: renamed above
		`SELECT pg_logical_emit_message(true, 'jetbox', jsonb_build_object('id', gen_random_uuid(), 'aggregate_type', 'order', 'aggregate_id', 'o-20', 'event_type', 'MessageSecond', 'payload', '{"total": 1.5}'::jsonb, 'headers', '{"traceparent": "00-1"}'::jsonb)::text)`},
	{`SELECT pg_logical_emit_message(true, 'jetbox', jsonb_build_object('id', gen_random_uuid(), 'aggregate_type', 'file', 'aggregate_id', 'f-1', 'event_type', 'Uploaded', 'payload_base64', encode('\x00ff0a'::bytea, 'base64'))::text)`,
		`SELECT pg_logical_emit_message(true, 'jetbox', '{"id": "bad", "aggregate_type": "order"')`,
		`SELECT pg_logical_emit_message(true, 'other', 'not ours')`},
	{`SELECT pg_logical_emit_message(false, 'jetbox', '{"id": "nontx"}')`, `SELECT pg_logical_emit_message(false, 'jetbox-heartbeat', '')`,
		`INSERT INTO other (note) VALUES ('after messages')`},
}

// TestCaptureCorpus records real pgoutput traffic from a real Postgres into
// testdata/fuzz (the committed seed corpus of FuzzDecode, FuzzDecodeStream
// and FuzzEnvelope). It runs only with JETBOX_CAPTURE_CORPUS=1.
func TestCaptureCorpus(t *testing.T) {
	if os.Getenv("JETBOX_CAPTURE_CORPUS") != "1" {
		t.Skip("set JETBOX_CAPTURE_CORPUS=1 to re-record the seed corpus")
	}
	pg := testenv.StartPostgres(t)
	pg.Exec(t, `CREATE TABLE public.outbox (
		id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text NOT NULL, aggregate_id text NOT NULL,
		event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL DEFAULT now());
		CREATE TABLE other (id bigserial PRIMARY KEY, note text);
		CREATE PUBLICATION capture FOR ALL TABLES`)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cc, err := pgconn.ParseConfig(pg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cc.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := pglogrepl.CreateReplicationSlot(ctx, conn, "capture", "pgoutput", pglogrepl.CreateReplicationSlotOptions{Temporary: true}); err != nil {
		t.Fatal(err)
	}
	if err := pglogrepl.StartReplication(ctx, conn, "capture", 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'capture'", "messages 'true'"}}); err != nil {
		t.Fatal(err)
	}
	workloads := append(append([][]string(nil), captureWorkloads...), captureMessageWorkloads...)
	for _, w := range workloads {
		pg.Exec(t, strings.Join(w, "; "))
	}
	pg.Exec(t, "INSERT INTO other (note) VALUES ('end')") // a last transaction to wait for
	var session [][]byte
	commits := 0
	for commits < len(workloads)+1 {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || cd.Data[0] != pglogrepl.XLogDataByteID {
			continue
		}
		xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
		if err != nil {
			t.Fatal(err)
		}
		session = append(session, append([]byte(nil), xld.WALData...))
		if xld.WALData[0] == 'C' {
			commits++
		}
	}
	dir := filepath.Join("testdata", "fuzz")
	for _, m := range session {
		writeCorpus(t, filepath.Join(dir, "FuzzDecode"), m)
		var lm pglogrepl.LogicalDecodingMessage
		if m[0] == 'M' && lm.Decode(m[1:]) == nil && lm.Prefix == "jetbox" {
			writeCorpus(t, filepath.Join(dir, "FuzzEnvelope"), lm.Content)
		}
	}
	writeCorpus(t, filepath.Join(dir, "FuzzDecodeStream"), joinMessages(session))
	t.Logf("recorded %d pgoutput messages", len(session))
}

// joinMessages frames messages as FuzzDecodeStream reads them: a 4-byte
// big-endian length before each.
func joinMessages(msgs [][]byte) []byte {
	var b []byte
	for _, m := range msgs {
		b = binary.BigEndian.AppendUint32(b, uint32(len(m)))
		b = append(b, m...)
	}
	return b
}

func writeCorpus(t *testing.T, dir string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("pg-%x", sha256.Sum256(data))[:19]
	body := "go test fuzz v1\n[]byte(" + strconv.Quote(string(data)) + ")\n"
	if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}
