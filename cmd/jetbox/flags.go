package main

// The flags of jetbox run (and of the commands that take its flags), their
// defaults and their groups in --help. config.go validates them.

import (
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kong"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go"
)

// DefaultDelivery is the default of --delivery: jetbox owns the stream, and
// replays are skipped by position whatever the duplicate window. Shared
// streams need --delivery=dedup (see sink.Publisher.Check).
const DefaultDelivery = "exactly-once"

// flagVars are the variables kong interpolates into the flag tags: the
// defaults that the packages apply themselves come from their constants, so
// each default has one source (TestFlagDefaults checks they agree).
var flagVars = map[string]string{
	"default_delivery":              DefaultDelivery,
	"default_nats_url":              nats.DefaultURL,
	"default_id_column":             decoder.DefaultColumns.ID,
	"default_aggregate_type_column": decoder.DefaultColumns.AggregateType,
	"default_aggregate_id_column":   decoder.DefaultColumns.AggregateID,
	"default_event_type_column":     decoder.DefaultColumns.EventType,
	"default_payload_column":        decoder.DefaultColumns.Payload,
	"default_headers_column":        decoder.DefaultColumns.Headers,
	"default_max_in_flight":         strconv.Itoa(sink.DefaultMaxPending),
	"default_publish_timeout":       durationText(sink.DefaultPublishTimeout),
	"default_nats_max_control_line": strconv.Itoa(sink.DefaultMaxControlLine),
	"default_status_interval":       durationText(replication.DefaultStatusInterval),
	"default_postgres_timeout":      durationText(replication.DefaultTimeout),
	"default_shutdown_timeout":      durationText(replication.DefaultShutdownTimeout),
	"default_standby_retry":         durationText(replication.DefaultStandbyRetry),
	"default_monitor_interval":      durationText(replication.DefaultMonitorInterval),
	"default_standby_slot_timeout":  durationText(replication.DefaultStandbySlotTimeout),
}

// durationText is d as a flag default is written: 2m rather than 2m0s.
func durationText(d time.Duration) string {
	s := d.String()
	if t, ok := strings.CutSuffix(s, "m0s"); ok {
		s = t + "m"
	}
	if t, ok := strings.CutSuffix(s, "h0m"); ok {
		s = t + "h"
	}
	return s
}

// flagGroups order and title the flags in --help.
var flagGroups = []kong.Group{
	{Key: "postgres", Title: "Postgres and the outbox"},
	{Key: "columns", Title: "Outbox columns"},
	{Key: "nats", Title: "NATS"},
	{Key: "stream", Title: "Stream and subjects"},
	{Key: "delivery", Title: "Delivery and recovery"},
	{Key: "timing", Title: "Timing and limits"},
	{Key: "ops", Title: "Operations (HTTP, logs)"},
	{Key: "audit", Title: "Continuous audit"},
}

// Help lists, below the description, what only variables configure.
func (f *RunFlags) Help() string {
	return `Tracing (OpenTelemetry, variables only; docs/operations.md#tracing):
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT   turn tracing on (OTLP)
  OTEL_TRACES_EXPORTER                   otlp (default), console or none
  OTEL_EXPORTER_OTLP_PROTOCOL            http/protobuf (default) or grpc
  OTEL_PROPAGATORS                       tracecontext,baggage (default), b3, b3multi, jaeger, ...
  OTEL_TRACES_SAMPLER(_ARG)              e.g. parentbased_traceidratio with 0.1
  OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*, OTEL_SDK_DISABLED
Memory and GC: GOMEMLIMIT, GOGC (docs/configuration.md).`
}

// RunFlags are the flags of `jetbox run`. Every flag has a JETBOX_* variable.
// The typed ones (durationFlag, intFlag, sizeFlag, boolFlag: flagvalues.go)
// keep a value that does not parse instead of failing kong's parse, and
// Config validates every flag together, so one run reports every mistake at
// once.
type RunFlags struct {
	PostgresURL     string       `name:"postgres-url" env:"JETBOX_POSTGRES_URL" help:"Postgres libpq URL or DSN (PG* variables and sslmode work). Required." placeholder:"URL" group:"postgres"`
	PrimaryURL      string       `name:"primary-url" env:"JETBOX_PRIMARY_URL" help:"When --postgres-url is a hot standby (PostgreSQL 16+): its primary's URL, same database, for what a standby cannot do (create the publication, heartbeats, standby snapshots while the slot is created). Optional." placeholder:"URL" group:"postgres"`
	StandbyURLs     string       `name:"standby-urls" env:"JETBOX_STANDBY_URLS" help:"PostgreSQL 17+ standbys that synchronise jetbox's failover slot, comma-separated libpq URLs (one host each): the instance that streams reads there every --monitor-interval whether the slot's copy is persisted (jetbox_failover_slot_ready, /readyz, jetbox check) and asks them to synchronise it (pg_sync_replication_slots()) while it is not." placeholder:"URLS" group:"postgres"`
	WaitSlots       string       `name:"wait-for-standby-slots" env:"JETBOX_WAIT_FOR_STANDBY_SLOTS" help:"Physical replication slots of standbys, comma-separated: publish a transaction only once each of them has flushed it, so a promoted standby holds every row jetbox published (PostgreSQL 14-16; on 17+ the server's synchronized_standby_slots does this for failover slots). The slots must exist on the primary." placeholder:"SLOTS" group:"postgres"`
	StandbySlotWait durationFlag `name:"standby-slot-timeout" env:"JETBOX_STANDBY_SLOT_TIMEOUT" default:"${default_standby_slot_timeout}" help:"With --wait-for-standby-slots: after a transaction has waited this long for the standbys, warn (log, jetbox_standby_slot_waiting, /readyz) and apply --on-standby-slot-timeout (default: ${default})." group:"postgres" placeholder:"DURATION"`
	OnStandbySlot   string       `name:"on-standby-slot-timeout" env:"JETBOX_ON_STANDBY_SLOT_TIMEOUT" default:"wait" help:"With --wait-for-standby-slots, once --standby-slot-timeout passed: wait (keep waiting for the standbys: the stream stops while they are down) or publish (go on without the guarantee until they catch up; jetbox_standby_slot_unguarded is 1)." group:"postgres"`
	NatsURL         string       `name:"nats-url" env:"JETBOX_NATS_URL" default:"${default_nats_url}" help:"NATS server URL(s), comma-separated." group:"nats"`
	NatsContext     string       `name:"nats-context" env:"JETBOX_NATS_CONTEXT" help:"A nats CLI context (its name, or the path of its file) for the NATS URL, credentials and TLS; the --nats-* flags given override it." placeholder:"NAME" group:"nats"`
	NatsStoreDir    string       `name:"nats-store-dir" env:"JETBOX_NATS_STORE_DIR" help:"With --nats-url=embedded: the JetStream store directory (required)." placeholder:"DIR" group:"nats"`
	NatsListen      string       `name:"nats-listen" env:"JETBOX_NATS_LISTEN" default:"127.0.0.1:4222" help:"With --nats-url=embedded: where the embedded server listens for consumers." group:"nats"`
	NatsCreds       string       `name:"nats-creds" env:"JETBOX_NATS_CREDS" help:"NATS credentials file (JWT + NKey)." placeholder:"FILE" group:"nats"`
	NatsNKey        string       `name:"nats-nkey" env:"JETBOX_NATS_NKEY" help:"NATS NKey seed file." placeholder:"FILE" group:"nats"`
	NatsUser        string       `name:"nats-user" env:"JETBOX_NATS_USER" help:"NATS user (with --nats-password)." group:"nats"`
	NatsPassword    string       `name:"nats-password" env:"JETBOX_NATS_PASSWORD" help:"NATS password." group:"nats"`
	NatsToken       string       `name:"nats-token" env:"JETBOX_NATS_TOKEN" help:"NATS token." group:"nats"`
	NatsTLSCA       string       `name:"nats-tls-ca" env:"JETBOX_NATS_TLS_CA" help:"CA certificate(s) to verify the NATS server, PEM." placeholder:"FILE" group:"nats"`
	NatsTLSCert     string       `name:"nats-tls-cert" env:"JETBOX_NATS_TLS_CERT" help:"Client certificate for NATS, PEM (with --nats-tls-key)." placeholder:"FILE" group:"nats"`
	NatsTLSKey      string       `name:"nats-tls-key" env:"JETBOX_NATS_TLS_KEY" help:"Client key for NATS, PEM." placeholder:"FILE" group:"nats"`
	NatsInboxPrefix string       `name:"nats-inbox-prefix" env:"JETBOX_NATS_INBOX_PREFIX" help:"Prefix of the reply subjects jetbox subscribes to (PubAcks, JetStream API replies) instead of _INBOX, for accounts that allow subscribing only under it." placeholder:"PREFIX" group:"nats"`
	NatsJSDomain    string       `name:"nats-js-domain" env:"JETBOX_NATS_JS_DOMAIN" help:"JetStream domain of the stream, for a stream in a hub reached through a leafnode (its API is $JS.<domain>.API)." placeholder:"DOMAIN" group:"nats"`
	NatsMaxCtlLine  intFlag      `name:"nats-max-control-line" env:"JETBOX_NATS_MAX_CONTROL_LINE" default:"${default_nats_max_control_line}" help:"The NATS server's max_control_line (servers do not announce it): a row whose subject would not fit, with the reply and sizes, is invalid (bad-subject) instead of making the server close the connection (default: ${default})." group:"nats" placeholder:"BYTES"`
	Table           string       `name:"table" env:"JETBOX_TABLE" default:"public.outbox" help:"Outbox table, schema.name." group:"postgres"`
	Slot            string       `name:"slot" env:"JETBOX_SLOT" default:"jetbox" help:"Logical replication slot (created if missing)." group:"postgres"`
	Publication     string       `name:"publication" env:"JETBOX_PUBLICATION" default:"jetbox" help:"Publication (created if missing)." group:"postgres"`
	Stream          string       `name:"stream" env:"JETBOX_STREAM" default:"OUTBOX" help:"JetStream stream (created if missing)." group:"stream"`
	SubjectPrefix   string       `name:"subject-prefix" env:"JETBOX_SUBJECT_PREFIX" default:"outbox" help:"Subjects are <prefix>.<aggregate_type>.<event_type> (see --subject-template)." group:"stream"`
	Source          string       `name:"source" env:"JETBOX_SOURCE" default:"table" help:"Where outbox events come from: table (rows of --table), messages (pg_logical_emit_message(true, <message-prefix>, envelope): no table; PostgreSQL 14+), or table,messages (see docs/routing.md)." group:"postgres"`
	MessagePrefix   string       `name:"message-prefix" env:"JETBOX_MESSAGE_PREFIX" default:"jetbox" help:"With --source including messages: the logical decoding message prefix of outbox events; other prefixes are ignored." group:"postgres"`
	SubjectTemplate string       `name:"subject-template" env:"JETBOX_SUBJECT_TEMPLATE" default:"{prefix}.{aggregate_type}.{event_type}" help:"Subject of each event: {prefix} first, then tokens made of literals and {aggregate_type}, {aggregate_id}, {event_type}, {partition} (see docs/routing.md)." group:"stream"`
	Partitions      intFlag      `name:"partitions" env:"JETBOX_PARTITIONS" default:"0" help:"N for {partition}: FNV-1a 32 of aggregate_id modulo N (the same as a stream transform's partition()); 0: none. {partition} needs 1 or more (default: ${default})." group:"stream" placeholder:"N"`
	HTTPAddr        string       `name:"http-addr" env:"JETBOX_HTTP_ADDR" default:"127.0.0.1:8080" help:"Address for /metrics, /healthz and /readyz; empty disables." group:"ops"`
	FinalScrape     durationFlag `name:"final-scrape-wait" env:"JETBOX_FINAL_SCRAPE_WAIT" default:"1m" help:"After stopping on an invalid row (--on-invalid=stop), keep serving /metrics until it is scraped once more, at most this long, so that jetbox_invalid_rows_total{action=\"stop\"} reaches Prometheus (a restart would stop on the same row); 0: exit at once (default: ${default})." group:"ops" placeholder:"DURATION"`
	PprofAddr       string       `name:"pprof-addr" env:"JETBOX_PPROF_ADDR" help:"Serve Go's net/http/pprof on this address, for profiling (no authentication: never expose it); empty disables." group:"ops"`

	IDColumn            string `name:"id-column" env:"JETBOX_ID_COLUMN" default:"${default_id_column}" help:"Row id column (uuid or text): Nats-Msg-Id." group:"columns"`
	AggregateTypeColumn string `name:"aggregate-type-column" env:"JETBOX_AGGREGATE_TYPE_COLUMN" default:"${default_aggregate_type_column}" help:"Aggregate type column (text)." group:"columns"`
	AggregateIDColumn   string `name:"aggregate-id-column" env:"JETBOX_AGGREGATE_ID_COLUMN" default:"${default_aggregate_id_column}" help:"Aggregate id column (text)." group:"columns"`
	EventTypeColumn     string `name:"event-type-column" env:"JETBOX_EVENT_TYPE_COLUMN" default:"${default_event_type_column}" help:"Event type column (text)." group:"columns"`
	PayloadColumn       string `name:"payload-column" env:"JETBOX_PAYLOAD_COLUMN" default:"${default_payload_column}" help:"Payload column (jsonb, json, text or bytea)." group:"columns"`
	HeadersColumn       string `name:"headers-column" env:"JETBOX_HEADERS_COLUMN" default:"${default_headers_column}" help:"Headers column (jsonb object of strings); empty to ignore." group:"columns"`

	DuplicateWindow  durationFlag `name:"duplicate-window" env:"JETBOX_DUPLICATE_WINDOW" help:"Duplicate window of a stream jetbox creates. Default (empty or auto): 1s with --delivery=exactly-once, which does not rely on it (every publish expects the stream's last sequence); --max-outage with --delivery=dedup. An existing stream with another window is reported, not changed." placeholder:"DURATION" group:"stream"`
	StreamReplicas   intFlag      `name:"stream-replicas" env:"JETBOX_STREAM_REPLICAS" help:"Replicas of a stream jetbox creates, 1-5. Default (empty or auto): 3 on a JetStream cluster (fewer if it advertises fewer servers), 1 on a single server." placeholder:"N" group:"stream"`
	StreamMaxAge     durationFlag `name:"stream-max-age" env:"JETBOX_STREAM_MAX_AGE" help:"Max age of a stream jetbox creates; default 0: none (exactly-once resumes from the stream's last message, which a max age expires after a quiet spell: it must exceed --max-outage)." placeholder:"DURATION" group:"stream"`
	StreamMaxBytes   sizeFlag     `name:"stream-max-bytes" env:"JETBOX_STREAM_MAX_BYTES" help:"Byte limit of a stream jetbox creates (e.g. 50GiB); default -1: none, the account's JetStream limits apply." placeholder:"SIZE" group:"stream"`
	StreamMaxMsgs    intFlag      `name:"stream-max-msgs" env:"JETBOX_STREAM_MAX_MSGS" help:"Message limit of a stream jetbox creates; default -1: none." placeholder:"N" group:"stream"`
	StreamStorage    string       `name:"stream-storage" env:"JETBOX_STREAM_STORAGE" help:"Storage of a stream jetbox creates: file (the default) or memory (a restart of the server loses the messages)." placeholder:"file|memory" group:"stream"`
	StreamDiscard    string       `name:"stream-discard" env:"JETBOX_STREAM_DISCARD" help:"At a limit, a stream jetbox creates discards old messages (old, the default: consumers that lag behind the limit miss them) or refuses new ones (new: jetbox stops publishing and the slot retains WAL until there is room)." placeholder:"old|new" group:"stream"`
	MaxInFlight      intFlag      `name:"max-in-flight" env:"JETBOX_MAX_IN_FLIGHT" default:"${default_max_in_flight}" help:"Events published and not yet acked (default: ${default})." group:"delivery" placeholder:"N"`
	MaxInFlightBytes sizeFlag     `name:"max-in-flight-bytes" env:"JETBOX_MAX_IN_FLIGHT_BYTES" default:"8MiB" help:"Payload bytes published and not yet acked (with the soft memory limit, see GOMEMLIMIT in docs/configuration.md, this bounds the memory) (default: ${default})." group:"delivery" placeholder:"SIZE"`
	PublishTimeout   durationFlag `name:"publish-timeout" env:"JETBOX_PUBLISH_TIMEOUT" default:"${default_publish_timeout}" help:"Wait for one PubAck before the outcome counts as unknown (default: ${default})." group:"delivery" placeholder:"DURATION"`
	Delivery         string       `name:"delivery" env:"JETBOX_DELIVERY" default:"${default_delivery}" help:"exactly-once: jetbox is the stream's only writer (a stream of its own, limits retention), publishes expect the last sequence and replays are skipped by position, whatever the window; dedup: for streams shared with other publishers, Nats-Msg-Id dedup within the duplicate window." group:"delivery"`
	AtomicTx         boolFlag     `name:"atomic-transactions" env:"JETBOX_ATOMIC_TRANSACTIONS" default:"false" help:"Store each transaction as JetStream atomic batches, so consumers never see part of one (up to the server's batch limit, 1000 rows by default; larger ones arrive in atomic chunks, the last message has Jetbox-Tx-Last: true). Needs --delivery=exactly-once, nats-server 2.12+ and a stream that allows atomic publish." group:"delivery"`
	OnInvalid        string       `name:"on-invalid" env:"JETBOX_ON_INVALID" default:"stop" help:"A row that cannot be published: stop (exit 1, slot kept before it) or dead-letter (publish it to --dead-letter-subject.<reason> and go on)." group:"delivery"`
	DeadLetterSubj   string       `name:"dead-letter-subject" env:"JETBOX_DEAD_LETTER_SUBJECT" help:"With --on-invalid=dead-letter: subject prefix for dead letters, captured by the stream. Default <subject-prefix>._dlq." placeholder:"SUBJECT" group:"delivery"`
	OrderGuard       boolFlag     `name:"order-guard" env:"JETBOX_ORDER_GUARD" default:"true" help:"Send Nats-Expected-Last-Sequence so the stream never holds a gap or reordering (needs jetbox to be the stream's only writer)." group:"delivery"`
	AllowRouting     boolFlag     `name:"allow-routing-change" env:"JETBOX_ALLOW_ROUTING_CHANGE" default:"false" help:"Go on under another --subject-template or --partitions than the stream's last message was routed under, instead of stopping with exit 2: an aggregate's events move to other subjects. Drain the consumers of the old subjects first; the check is moot once one message under the new routing is stored." group:"delivery"`
	AcceptLostRows   boolFlag     `name:"accept-lost-rows" env:"JETBOX_ACCEPT_LOST_ROWS" default:"false" help:"Go on where the server does not continue the stream's history (its slot is lost after a failover or drop, its WAL is behind the stream after a restore, its timeline branched before the stream's last row) instead of stopping with exit 2. Rows committed in between may then be missing: prefer jetbox repair." group:"delivery"`
	OnLostSlot       string       `name:"on-lost-slot" env:"JETBOX_ON_LOST_SLOT" default:"stop" help:"jetbox run, when the slot is lost (missing on a promoted server, invalidated, dropped) while the stream holds rows from it: stop (exit 2, run jetbox repair) or repair (the instance that finds it runs jetbox repair's steps itself, one instance at a time, then streams; what jetbox repair refuses or needs a flag for still stops) (default: ${default})." group:"delivery" placeholder:"stop|repair"`
	LostSlotMargin   durationFlag `name:"on-lost-slot-margin" env:"JETBOX_ON_LOST_SLOT_MARGIN" default:"10m" help:"With --on-lost-slot=repair: the overlap read before the stream's last event (jetbox repair's --margin): the longest transaction plus the clock skew between Postgres and NATS (default: ${default})." group:"delivery" placeholder:"DURATION"`
	StatusInterval   durationFlag `name:"status-interval" env:"JETBOX_STATUS_INTERVAL" default:"${default_status_interval}" help:"Standby status update period (default: ${default})." group:"timing" placeholder:"DURATION"`
	PostgresTimeout  durationFlag `name:"postgres-timeout" env:"JETBOX_POSTGRES_TIMEOUT" default:"${default_postgres_timeout}" help:"Reconnect when Postgres sends nothing for this long (default: ${default})." group:"timing" placeholder:"DURATION"`
	ShutdownTimeout  durationFlag `name:"shutdown-timeout" env:"JETBOX_SHUTDOWN_TIMEOUT" default:"${default_shutdown_timeout}" help:"On stop, wait this long for in-flight acks (default: ${default})." group:"timing" placeholder:"DURATION"`
	StandbyRetry     durationFlag `name:"standby-retry" env:"JETBOX_STANDBY_RETRY" default:"${default_standby_retry}" help:"While another instance holds the slot, retry this often (sets the takeover time) (default: ${default})." group:"timing" placeholder:"DURATION"`
	Heartbeat        durationFlag `name:"heartbeat-interval" env:"JETBOX_HEARTBEAT_INTERVAL" default:"0s" help:"Write a heartbeat (pg_logical_emit_message) this often; 0 disables (default: ${default})." group:"timing" placeholder:"DURATION"`
	MaxRetainedWAL   sizeFlag     `name:"max-retained-wal" env:"JETBOX_MAX_RETAINED_WAL" default:"1GiB" help:"Warn (log, metric, /readyz) when the slot retains more WAL; 0 disables (default: ${default})." group:"timing" placeholder:"SIZE"`
	MonitorInterval  durationFlag `name:"monitor-interval" env:"JETBOX_MONITOR_INTERVAL" default:"${default_monitor_interval}" help:"How often to read the slot's lag and retained WAL (metrics, /readyz, the retained-WAL warning) (default: ${default})." group:"timing" placeholder:"DURATION"`
	MaxOutage        durationFlag `name:"max-outage" env:"JETBOX_MAX_OUTAGE" default:"10m" help:"Worst-case outage to plan for: check warns when the stream's duplicate window is shorter (default: ${default})." group:"timing" placeholder:"DURATION"`
	LogLevel         string       `name:"log-level" env:"JETBOX_LOG_LEVEL" default:"info" help:"debug, info, warn or error." group:"ops"`
	LogFormat        string       `name:"log-format" env:"JETBOX_LOG_FORMAT" default:"json" help:"json or console." group:"ops"`

	AuditInterval   durationFlag `name:"audit-interval" env:"JETBOX_AUDIT_INTERVAL" default:"0s" help:"jetbox run, the instance that streams: compare each new window of the outbox table with the stream this often (jetbox audit, continuously: metrics jetbox_audit_*, /readyz); 0 disables (default: ${default})." group:"audit" placeholder:"DURATION"`
	AuditGrace      durationFlag `name:"audit-grace" env:"JETBOX_AUDIT_GRACE" default:"1m" help:"With --audit-interval: audit a row once it is this old (longer than the replication lag, and with --created-at-column as the key than the longest transaction) (default: ${default})." group:"audit" placeholder:"DURATION"`
	AuditMargin     durationFlag `name:"audit-margin" env:"JETBOX_AUDIT_MARGIN" default:"10m" help:"With --audit-interval: the longest transaction plus the clock skew between Postgres and NATS (jetbox audit's --margin) (default: ${default})." group:"audit" placeholder:"DURATION"`
	CreatedAtColumn string       `name:"created-at-column" env:"JETBOX_CREATED_AT_COLUMN" default:"created_at" help:"Insert-time column (timestamptz) ordering the rows of jetbox repair and the audits when track_commit_timestamp is off." group:"columns"`
}
