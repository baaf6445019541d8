package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/alecthomas/kong"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
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
// Values are taken as strings and validated together by Config, so one run
// reports every mistake at once.
type RunFlags struct {
	PostgresURL     string `name:"postgres-url" env:"JETBOX_POSTGRES_URL" help:"Postgres libpq URL or DSN (PG* variables and sslmode work). Required." placeholder:"URL" group:"postgres"`
	NatsURL         string `name:"nats-url" env:"JETBOX_NATS_URL" default:"${default_nats_url}" help:"NATS server URL(s), comma-separated." group:"nats"`
	NatsContext     string `name:"nats-context" env:"JETBOX_NATS_CONTEXT" help:"A nats CLI context (its name, or the path of its file) for the NATS URL, credentials and TLS; the --nats-* flags given override it." placeholder:"NAME" group:"nats"`
	NatsStoreDir    string `name:"nats-store-dir" env:"JETBOX_NATS_STORE_DIR" help:"With --nats-url=embedded: the JetStream store directory (required)." placeholder:"DIR" group:"nats"`
	NatsListen      string `name:"nats-listen" env:"JETBOX_NATS_LISTEN" default:"127.0.0.1:4222" help:"With --nats-url=embedded: where the embedded server listens for consumers." group:"nats"`
	NatsCreds       string `name:"nats-creds" env:"JETBOX_NATS_CREDS" help:"NATS credentials file (JWT + NKey)." placeholder:"FILE" group:"nats"`
	NatsNKey        string `name:"nats-nkey" env:"JETBOX_NATS_NKEY" help:"NATS NKey seed file." placeholder:"FILE" group:"nats"`
	NatsUser        string `name:"nats-user" env:"JETBOX_NATS_USER" help:"NATS user (with --nats-password)." group:"nats"`
	NatsPassword    string `name:"nats-password" env:"JETBOX_NATS_PASSWORD" help:"NATS password." group:"nats"`
	NatsToken       string `name:"nats-token" env:"JETBOX_NATS_TOKEN" help:"NATS token." group:"nats"`
	NatsTLSCA       string `name:"nats-tls-ca" env:"JETBOX_NATS_TLS_CA" help:"CA certificate(s) to verify the NATS server, PEM." placeholder:"FILE" group:"nats"`
	NatsTLSCert     string `name:"nats-tls-cert" env:"JETBOX_NATS_TLS_CERT" help:"Client certificate for NATS, PEM (with --nats-tls-key)." placeholder:"FILE" group:"nats"`
	NatsTLSKey      string `name:"nats-tls-key" env:"JETBOX_NATS_TLS_KEY" help:"Client key for NATS, PEM." placeholder:"FILE" group:"nats"`
	NatsInboxPrefix string `name:"nats-inbox-prefix" env:"JETBOX_NATS_INBOX_PREFIX" help:"Prefix of the reply subjects jetbox subscribes to (PubAcks, JetStream API replies) instead of _INBOX, for accounts that allow subscribing only under it." placeholder:"PREFIX" group:"nats"`
	NatsJSDomain    string `name:"nats-js-domain" env:"JETBOX_NATS_JS_DOMAIN" help:"JetStream domain of the stream, for a stream in a hub reached through a leafnode (its API is $JS.<domain>.API)." placeholder:"DOMAIN" group:"nats"`
	NatsMaxCtlLine  string `name:"nats-max-control-line" env:"JETBOX_NATS_MAX_CONTROL_LINE" default:"${default_nats_max_control_line}" help:"The NATS server's max_control_line (servers do not announce it): a row whose subject would not fit, with the reply and sizes, is invalid (bad-subject) instead of making the server close the connection (default: ${default})." group:"nats" placeholder:"BYTES"`
	StandbyURLs     string `name:"standby-urls" env:"JETBOX_STANDBY_URLS" help:"PostgreSQL 17+ standbys that synchronise jetbox's failover slot, comma-separated libpq URLs (one host each): the instance that streams reads there every --monitor-interval whether the slot's copy is persisted (jetbox_failover_slot_ready, /readyz, jetbox check) and asks them to synchronise it (pg_sync_replication_slots()) while it is not." placeholder:"URLS" group:"postgres"`
	Table           string `name:"table" env:"JETBOX_TABLE" default:"public.outbox" help:"Outbox table, schema.name." group:"postgres"`
	Slot            string `name:"slot" env:"JETBOX_SLOT" default:"jetbox" help:"Logical replication slot (created if missing)." group:"postgres"`
	Publication     string `name:"publication" env:"JETBOX_PUBLICATION" default:"jetbox" help:"Publication (created if missing)." group:"postgres"`
	Stream          string `name:"stream" env:"JETBOX_STREAM" default:"OUTBOX" help:"JetStream stream (created if missing)." group:"stream"`
	SubjectPrefix   string `name:"subject-prefix" env:"JETBOX_SUBJECT_PREFIX" default:"outbox" help:"Subjects are <prefix>.<aggregate_type>.<event_type> (see --subject-template)." group:"stream"`
	Source          string `name:"source" env:"JETBOX_SOURCE" default:"table" help:"Where outbox events come from: table (rows of --table), messages (pg_logical_emit_message(true, <message-prefix>, envelope): no table; PostgreSQL 14+), or table,messages (see docs/routing.md)." group:"postgres"`
	MessagePrefix   string `name:"message-prefix" env:"JETBOX_MESSAGE_PREFIX" default:"jetbox" help:"With --source including messages: the logical decoding message prefix of outbox events; other prefixes are ignored." group:"postgres"`
	SubjectTemplate string `name:"subject-template" env:"JETBOX_SUBJECT_TEMPLATE" default:"{prefix}.{aggregate_type}.{event_type}" help:"Subject of each event: {prefix} first, then tokens made of literals and {aggregate_type}, {aggregate_id}, {event_type}, {partition} (see docs/routing.md)." group:"stream"`
	Partitions      string `name:"partitions" env:"JETBOX_PARTITIONS" default:"0" help:"N for {partition}: FNV-1a 32 of aggregate_id modulo N (the same as a stream transform's partition()); 0: none. {partition} needs 1 or more (default: ${default})." group:"stream" placeholder:"N"`
	HTTPAddr        string `name:"http-addr" env:"JETBOX_HTTP_ADDR" default:"127.0.0.1:8080" help:"Address for /metrics, /healthz and /readyz; empty disables." group:"ops"`
	FinalScrape     string `name:"final-scrape-wait" env:"JETBOX_FINAL_SCRAPE_WAIT" default:"1m" help:"After stopping on an invalid row (--on-invalid=stop), keep serving /metrics until it is scraped once more, at most this long, so that jetbox_invalid_rows_total{action=\"stop\"} reaches Prometheus (a restart would stop on the same row); 0: exit at once (default: ${default})." group:"ops" placeholder:"DURATION"`
	PprofAddr       string `name:"pprof-addr" env:"JETBOX_PPROF_ADDR" help:"Serve Go's net/http/pprof on this address, for profiling (no authentication: never expose it); empty disables." group:"ops"`

	IDColumn            string `name:"id-column" env:"JETBOX_ID_COLUMN" default:"${default_id_column}" help:"Row id column (uuid or text): Nats-Msg-Id." group:"columns"`
	AggregateTypeColumn string `name:"aggregate-type-column" env:"JETBOX_AGGREGATE_TYPE_COLUMN" default:"${default_aggregate_type_column}" help:"Aggregate type column (text)." group:"columns"`
	AggregateIDColumn   string `name:"aggregate-id-column" env:"JETBOX_AGGREGATE_ID_COLUMN" default:"${default_aggregate_id_column}" help:"Aggregate id column (text)." group:"columns"`
	EventTypeColumn     string `name:"event-type-column" env:"JETBOX_EVENT_TYPE_COLUMN" default:"${default_event_type_column}" help:"Event type column (text)." group:"columns"`
	PayloadColumn       string `name:"payload-column" env:"JETBOX_PAYLOAD_COLUMN" default:"${default_payload_column}" help:"Payload column (jsonb, json, text or bytea)." group:"columns"`
	HeadersColumn       string `name:"headers-column" env:"JETBOX_HEADERS_COLUMN" default:"${default_headers_column}" help:"Headers column (jsonb object of strings); empty to ignore." group:"columns"`

	DuplicateWindow  string   `name:"duplicate-window" env:"JETBOX_DUPLICATE_WINDOW" help:"Duplicate window of a stream jetbox creates. Default (empty or auto): 2 x --publish-timeout (jetbox's own retries) with --delivery=exactly-once, which skips replays by position; --max-outage with --delivery=dedup. An existing stream with another window is reported, not changed." placeholder:"DURATION" group:"stream"`
	StreamReplicas   string   `name:"stream-replicas" env:"JETBOX_STREAM_REPLICAS" help:"Replicas of a stream jetbox creates, 1-5. Default (empty or auto): 3 on a JetStream cluster (fewer if it advertises fewer servers), 1 on a single server." placeholder:"N" group:"stream"`
	StreamMaxAge     string   `name:"stream-max-age" env:"JETBOX_STREAM_MAX_AGE" help:"Max age of a stream jetbox creates; default 0: none (exactly-once resumes from the stream's last message, which a max age expires after a quiet spell: it must exceed --max-outage)." placeholder:"DURATION" group:"stream"`
	StreamMaxBytes   string   `name:"stream-max-bytes" env:"JETBOX_STREAM_MAX_BYTES" help:"Byte limit of a stream jetbox creates (e.g. 50GiB); default -1: none, the account's JetStream limits apply." placeholder:"SIZE" group:"stream"`
	StreamMaxMsgs    string   `name:"stream-max-msgs" env:"JETBOX_STREAM_MAX_MSGS" help:"Message limit of a stream jetbox creates; default -1: none." placeholder:"N" group:"stream"`
	StreamStorage    string   `name:"stream-storage" env:"JETBOX_STREAM_STORAGE" help:"Storage of a stream jetbox creates: file (the default) or memory (a restart of the server loses the messages)." placeholder:"file|memory" group:"stream"`
	StreamDiscard    string   `name:"stream-discard" env:"JETBOX_STREAM_DISCARD" help:"At a limit, a stream jetbox creates discards old messages (old, the default: consumers that lag behind the limit miss them) or refuses new ones (new: jetbox stops publishing and the slot retains WAL until there is room)." placeholder:"old|new" group:"stream"`
	MaxInFlight      string   `name:"max-in-flight" env:"JETBOX_MAX_IN_FLIGHT" default:"${default_max_in_flight}" help:"Events published and not yet acked (default: ${default})." group:"delivery" placeholder:"N"`
	MaxInFlightBytes string   `name:"max-in-flight-bytes" env:"JETBOX_MAX_IN_FLIGHT_BYTES" default:"8MiB" help:"Payload bytes published and not yet acked (with the soft memory limit, see GOMEMLIMIT in docs/configuration.md, this bounds the memory) (default: ${default})." group:"delivery" placeholder:"SIZE"`
	PublishTimeout   string   `name:"publish-timeout" env:"JETBOX_PUBLISH_TIMEOUT" default:"${default_publish_timeout}" help:"Wait for one PubAck before the outcome counts as unknown (default: ${default})." group:"delivery" placeholder:"DURATION"`
	Delivery         string   `name:"delivery" env:"JETBOX_DELIVERY" default:"${default_delivery}" help:"exactly-once: jetbox is the stream's only writer (a stream of its own, limits retention), publishes expect the last sequence and replays are skipped by position, whatever the window; dedup: for streams shared with other publishers, Nats-Msg-Id dedup within the duplicate window." group:"delivery"`
	AtomicTx         boolText `name:"atomic-transactions" env:"JETBOX_ATOMIC_TRANSACTIONS" default:"false" help:"Store each transaction as JetStream atomic batches, so consumers never see part of one (up to the server's batch limit, 1000 rows by default; larger ones arrive in atomic chunks, the last message has Jetbox-Tx-Last: true). Needs --delivery=exactly-once, nats-server 2.12+ and a stream that allows atomic publish." group:"delivery"`
	OnInvalid        string   `name:"on-invalid" env:"JETBOX_ON_INVALID" default:"stop" help:"A row that cannot be published: stop (exit 1, slot kept before it) or dead-letter (publish it to --dead-letter-subject.<reason> and go on)." group:"delivery"`
	DeadLetterSubj   string   `name:"dead-letter-subject" env:"JETBOX_DEAD_LETTER_SUBJECT" help:"With --on-invalid=dead-letter: subject prefix for dead letters, captured by the stream. Default <subject-prefix>._dlq." placeholder:"SUBJECT" group:"delivery"`
	OrderGuard       boolText `name:"order-guard" env:"JETBOX_ORDER_GUARD" default:"true" help:"Send Nats-Expected-Last-Sequence so the stream never holds a gap or reordering (needs jetbox to be the stream's only writer)." group:"delivery"`
	AllowRouting     boolText `name:"allow-routing-change" env:"JETBOX_ALLOW_ROUTING_CHANGE" default:"false" help:"Go on under another --subject-template or --partitions than the stream's last message was routed under, instead of stopping with exit 2: an aggregate's events move to other subjects. Drain the consumers of the old subjects first; the check is moot once one message under the new routing is stored." group:"delivery"`
	AcceptLostRows   boolText `name:"accept-lost-rows" env:"JETBOX_ACCEPT_LOST_ROWS" default:"false" help:"Go on where the server does not continue the stream's history (its slot is lost after a failover or drop, its WAL is behind the stream after a restore, its timeline branched before the stream's last row) instead of stopping with exit 2. Rows committed in between may then be missing: prefer jetbox repair." group:"delivery"`
	StatusInterval   string   `name:"status-interval" env:"JETBOX_STATUS_INTERVAL" default:"${default_status_interval}" help:"Standby status update period (default: ${default})." group:"timing" placeholder:"DURATION"`
	PostgresTimeout  string   `name:"postgres-timeout" env:"JETBOX_POSTGRES_TIMEOUT" default:"${default_postgres_timeout}" help:"Reconnect when Postgres sends nothing for this long (default: ${default})." group:"timing" placeholder:"DURATION"`
	ShutdownTimeout  string   `name:"shutdown-timeout" env:"JETBOX_SHUTDOWN_TIMEOUT" default:"${default_shutdown_timeout}" help:"On stop, wait this long for in-flight acks (default: ${default})." group:"timing" placeholder:"DURATION"`
	StandbyRetry     string   `name:"standby-retry" env:"JETBOX_STANDBY_RETRY" default:"${default_standby_retry}" help:"While another instance holds the slot, retry this often (sets the takeover time) (default: ${default})." group:"timing" placeholder:"DURATION"`
	Heartbeat        string   `name:"heartbeat-interval" env:"JETBOX_HEARTBEAT_INTERVAL" default:"0s" help:"Write a heartbeat (pg_logical_emit_message) this often; 0 disables (default: ${default})." group:"timing" placeholder:"DURATION"`
	MaxRetainedWAL   string   `name:"max-retained-wal" env:"JETBOX_MAX_RETAINED_WAL" default:"1GiB" help:"Warn (log, metric, /readyz) when the slot retains more WAL; 0 disables (default: ${default})." group:"timing" placeholder:"SIZE"`
	MonitorInterval  string   `name:"monitor-interval" env:"JETBOX_MONITOR_INTERVAL" default:"${default_monitor_interval}" help:"How often to read the slot's lag and retained WAL (metrics, /readyz, the retained-WAL warning) (default: ${default})." group:"timing" placeholder:"DURATION"`
	MaxOutage        string   `name:"max-outage" env:"JETBOX_MAX_OUTAGE" default:"10m" help:"Worst-case outage to plan for: check warns when the stream's duplicate window is shorter (default: ${default})." group:"timing" placeholder:"DURATION"`
	LogLevel         string   `name:"log-level" env:"JETBOX_LOG_LEVEL" default:"info" help:"debug, info, warn or error." group:"ops"`
	LogFormat        string   `name:"log-format" env:"JETBOX_LOG_FORMAT" default:"json" help:"json or console." group:"ops"`

	AuditInterval   string `name:"audit-interval" env:"JETBOX_AUDIT_INTERVAL" default:"0s" help:"jetbox run, the instance that streams: compare each new window of the outbox table with the stream this often (jetbox audit, continuously: metrics jetbox_audit_*, /readyz); 0 disables (default: ${default})." group:"audit" placeholder:"DURATION"`
	AuditGrace      string `name:"audit-grace" env:"JETBOX_AUDIT_GRACE" default:"1m" help:"With --audit-interval: audit a row once it is this old (longer than the replication lag, and with --created-at-column as the key than the longest transaction) (default: ${default})." group:"audit" placeholder:"DURATION"`
	AuditMargin     string `name:"audit-margin" env:"JETBOX_AUDIT_MARGIN" default:"10m" help:"With --audit-interval: the longest transaction plus the clock skew between Postgres and NATS (jetbox audit's --margin) (default: ${default})." group:"audit" placeholder:"DURATION"`
	CreatedAtColumn string `name:"created-at-column" env:"JETBOX_CREATED_AT_COLUMN" default:"created_at" help:"Insert-time column (timestamptz) ordering the rows of jetbox repair and the audits when track_commit_timestamp is off." group:"columns"`
}

// Config is the validated configuration of `jetbox run`.
type Config struct {
	PostgresURL string
	// StandbyURLs are the standbys watched for the slot's copy (--standby-urls).
	StandbyURLs []string
	NatsURL     string
	NATS        NATSAuth
	// NatsListen and NatsStoreDir configure the embedded server (--nats-url=embedded).
	NatsListen, NatsStoreDir string
	HTTPAddr                 string
	MaxOutage                time.Duration
	// FinalScrapeWait: after a stop on an invalid row, serve /metrics until
	// it is scraped once more, at most this long (--final-scrape-wait).
	FinalScrapeWait time.Duration
	Replication     replication.Config
	Sink            sink.Config
	LogLevel        zerolog.Level
	LogConsole      bool
	Metrics         *metrics.Metrics // set by run
	// Audit is the continuous audit of jetbox run (--audit-interval).
	Audit AuditLoopConfig
}

// AuditLoopConfig configures the continuous audit (auditloop.go).
type AuditLoopConfig struct {
	Interval, Grace, Margin time.Duration // Interval 0: off
	PageSize                int
	CreatedAtColumn         string
}

// NATSAuth is how jetbox authenticates to NATS and verifies it.
type NATSAuth struct {
	Creds, NKey, User, Password, Token string
	TLSCA, TLSCert, TLSKey             string
	TLSFirst                           bool   // TLS before the server's INFO (a context's tls_first)
	UserJWT, UserSeed                  string // a context's user_jwt and user_seed
	InboxPrefix                        string // the reply subjects' prefix (nats.CustomInboxPrefix)
	// Name is the connection's name in the server's reports:
	// jetbox/<slot>/<hostname>, so instances can be told apart.
	Name string
}

// ConfigError is one invalid setting, with how to fix it.
type ConfigError struct {
	Flag, Env, Value string
	Problem          string
	Hint             string
}

func (e *ConfigError) Error() string {
	s := fmt.Sprintf("--%s (%s)", e.Flag, e.Env)
	if e.Value != "" {
		s += fmt.Sprintf(" = %q", e.Value)
	}
	return s + ": " + e.Problem + "; fix: " + e.Hint
}

var (
	slotName   = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
	streamName = regexp.MustCompile(`^[^\s.*>/\\]{1,255}$`)
	identName  = regexp.MustCompile(`^.{1,63}$`)
)

// Config validates the flags and returns every problem at once, joined.
func (f *RunFlags) Config() (Config, error) {
	var errs []error
	bad := func(flag, value, problem, fix string) {
		errs = append(errs, &ConfigError{Flag: flag, Env: envName(flag), Value: value, Problem: problem, Hint: fix})
	}
	dur := func(flag, v string, min, max time.Duration) time.Duration {
		d, err := time.ParseDuration(v)
		if err != nil {
			bad(flag, v, "not a duration", "use a Go duration such as 500ms, 30s or 2m")
			return 0
		}
		if d < min || (max > 0 && d > max) {
			bad(flag, v, "out of range", fmt.Sprintf("use a value between %s and %s", min, max))
		}
		return d
	}
	n := f.natsFlags(bad)
	c := Config{PostgresURL: f.PostgresURL, NatsURL: n.URL, HTTPAddr: f.HTTPAddr, NATS: NATSAuth{
		Creds: n.Creds, NKey: n.NKey, User: n.User, Password: n.Password, Token: n.Token,
		TLSCA: n.TLSCA, TLSCert: n.TLSCert, TLSKey: n.TLSKey, TLSFirst: n.TLSFirst, UserJWT: n.UserJWT, UserSeed: n.UserSeed,
		InboxPrefix: n.InboxPrefix, Name: connectionName(f.Slot)}}
	checkNATSNames(n, f.NatsContext, bad)
	kinds := 0
	for _, set := range []bool{f.NatsCreds != "", f.NatsNKey != "", f.NatsUser != "", f.NatsToken != ""} {
		if set {
			kinds++
		}
	}
	if kinds > 1 {
		bad("nats-creds", "", "more than one NATS credential kind given (creds, nkey, user/password, token)", "pass exactly one of them")
	}
	if (n.User == "") != (n.Password == "") {
		if n.fromContext["nats-user"] || n.fromContext["nats-password"] {
			bad("nats-context", f.NatsContext, "the user and the password (from the context and --nats-user/--nats-password) go together", "give both, or neither")
		} else {
			bad("nats-user", f.NatsUser, "--nats-user and --nats-password go together", "give both, or neither")
		}
	}
	if (n.TLSCert == "") != (n.TLSKey == "") {
		if n.fromContext["nats-tls-cert"] || n.fromContext["nats-tls-key"] {
			bad("nats-context", f.NatsContext, "the context's cert and key go together", "give both in the context, or --nats-tls-cert and --nats-tls-key")
		} else {
			bad("nats-tls-cert", f.NatsTLSCert, "--nats-tls-cert and --nats-tls-key go together", "give both, or neither")
		}
	}
	for flag, path := range map[string]string{"nats-creds": n.Creds, "nats-nkey": n.NKey, "nats-tls-ca": n.TLSCA, "nats-tls-cert": n.TLSCert, "nats-tls-key": n.TLSKey} {
		if path == "" {
			continue
		}
		if _, err := os.Stat(path); err != nil {
			if n.fromContext[flag] {
				bad("nats-context", f.NatsContext, "its "+strings.TrimPrefix(flag, "nats-")+" file: cannot read it: "+err.Error(), "check the path in the context and the permissions")
			} else {
				bad(flag, path, "cannot read the file: "+err.Error(), "check the path and permissions")
			}
		}
	}
	if f.HTTPAddr != "" {
		if _, _, err := net.SplitHostPort(f.HTTPAddr); err != nil {
			bad("http-addr", f.HTTPAddr, "not host:port", "use e.g. 127.0.0.1:8080 or :8080, or empty to disable")
		}
	}

	if f.PostgresURL == "" {
		bad("postgres-url", "", "required", "set JETBOX_POSTGRES_URL, e.g. postgres://jetbox:secret@127.0.0.1:5432/app?sslmode=disable")
	} else if _, err := pgconn.ParseConfig(f.PostgresURL); err != nil {
		bad("postgres-url", "", "cannot be parsed: "+redact(err.Error()), "use a libpq URL (postgres://user:pass@host:5432/db) or a key=value DSN")
	}
	c.StandbyURLs = standbyURLs(f.StandbyURLs, bad)
	if f.NatsURL == "embedded" {
		if f.NatsStoreDir == "" {
			bad("nats-store-dir", "", "required with --nats-url=embedded", "give a persistent directory for the embedded server's JetStream store")
		}
		if _, _, err := net.SplitHostPort(f.NatsListen); err != nil {
			bad("nats-listen", f.NatsListen, "not host:port", "use e.g. 127.0.0.1:4222")
		}
		c.NatsListen, c.NatsStoreDir = f.NatsListen, f.NatsStoreDir
	} else {
		for _, u := range strings.Split(n.URL, ",") {
			u = strings.TrimSpace(u)
			pu, err := url.Parse(u)
			if err != nil || pu.Host == "" || !map[string]bool{"nats": true, "tls": true, "ws": true, "wss": true}[pu.Scheme] {
				if n.fromContext["nats-url"] {
					bad("nats-context", f.NatsContext, "its url "+redact(u)+" is not a NATS URL", "fix the context's url, or give --nats-url")
				} else {
					bad("nats-url", u, "not a NATS URL", "use nats://host:4222 (or tls://, ws://, wss://; or embedded); separate several with commas")
				}
			}
		}
	}

	schema, table, ok := strings.Cut(f.Table, ".")
	if !ok {
		schema, table = "public", f.Table
	}
	if schema == "" || table == "" || strings.Contains(table, ".") || !identName.MatchString(schema) || !identName.MatchString(table) {
		bad("table", f.Table, "not a table name", "use schema.table as stored in the catalog, e.g. public.outbox")
	}
	if !slotName.MatchString(f.Slot) {
		bad("slot", f.Slot, "not a valid slot name", "use 1-63 lower-case letters, digits and underscores")
	}
	if !identName.MatchString(f.Publication) {
		bad("publication", f.Publication, "not a valid publication name", "use 1-63 characters")
	}
	if !streamName.MatchString(f.Stream) {
		bad("stream", f.Stream, "not a valid stream name", "use letters, digits, '-' or '_' (no spaces, '.', '*', '>', '/')")
	}
	if err := decoder.ValidPrefix(f.SubjectPrefix); err != nil {
		bad("subject-prefix", f.SubjectPrefix, err.Error(), "use dot-separated tokens without spaces or wildcards, e.g. outbox or acme.outbox")
	}
	fromTable, fromMessages := false, false
	for _, src := range strings.Split(f.Source, ",") {
		switch strings.TrimSpace(src) {
		case "table":
			if fromTable {
				bad("source", f.Source, "table is given twice", "use table, messages or table,messages")
			}
			fromTable = true
		case "messages":
			if fromMessages {
				bad("source", f.Source, "messages is given twice", "use table, messages or table,messages")
			}
			fromMessages = true
		default:
			bad("source", f.Source, fmt.Sprintf("unknown source %q", strings.TrimSpace(src)), "use table, messages or table,messages")
		}
	}
	messagePrefix := ""
	if fromMessages {
		messagePrefix = f.MessagePrefix
		if err := decoder.ValidMessagePrefix(f.MessagePrefix); err != nil {
			bad("message-prefix", f.MessagePrefix, err.Error(), "use the prefix your producers pass to pg_logical_emit_message: printable, without \"Nats-\" or spaces at the ends, at most "+strconv.Itoa(decoder.MaxMessagePrefix)+" bytes, e.g. jetbox (the default)")
		}
	}
	// The template's syntax and the partition count are checked apart, so
	// both problems are reported, each under its own flag; --partitions is
	// blamed only for not matching the template's {partition}.
	partitions, err := strconv.Atoi(f.Partitions)
	badPartitions := err != nil || partitions < 0 || partitions > 100000
	if badPartitions {
		bad("partitions", f.Partitions, "not a count between 0 and 100000", "use 0 (no {partition}) or e.g. 16")
	}
	hasPartition := strings.Contains(f.SubjectTemplate, decoder.TokenPartition)
	syntaxN := 0
	if hasPartition {
		syntaxN = 1
	}
	var subjects *decoder.Template
	if _, err := decoder.ParseTemplate(f.SubjectTemplate, syntaxN); err != nil {
		bad("subject-template", f.SubjectTemplate, err.Error(), "write tokens separated by '.', {prefix} first, e.g. {prefix}.{aggregate_type}.{partition}.{event_type} with --partitions=16 (see docs/routing.md)")
	} else if !badPartitions {
		if tpl, err := decoder.ParseTemplate(f.SubjectTemplate, partitions); err != nil {
			flag, value := "partitions", f.Partitions
			if hasPartition {
				flag, value = "subject-template", f.SubjectTemplate // {partition} without a count
			}
			bad(flag, value, err.Error(), "give --partitions=N (N ≥ 1) exactly when the template has {partition}, e.g. {prefix}.{aggregate_type}.{partition}.{event_type} with --partitions=16")
		} else if f.SubjectTemplate != decoder.DefaultSubjectTemplate {
			subjects = tpl // nil keeps the historical subject code and hints
		}
	}
	cols := decoder.Columns{ID: f.IDColumn, AggregateType: f.AggregateTypeColumn, AggregateID: f.AggregateIDColumn,
		EventType: f.EventTypeColumn, Payload: f.PayloadColumn, Headers: f.HeadersColumn}
	seen := map[string]string{}
	for _, fc := range []struct{ flag, col string }{{"id-column", cols.ID}, {"aggregate-type-column", cols.AggregateType},
		{"aggregate-id-column", cols.AggregateID}, {"event-type-column", cols.EventType},
		{"payload-column", cols.Payload}, {"headers-column", cols.Headers}} {
		switch other, dup := seen[fc.col]; {
		case fc.col == "" && fc.flag != "headers-column":
			bad(fc.flag, "", "empty", "name the column")
		case fc.col != "" && dup:
			bad(fc.flag, fc.col, "the same column as --"+other, "give each role its own column")
		}
		seen[fc.col] = fc.flag
	}

	// Below the 2-minute bound jetbox waits for a session's acks before republishing.
	publishTimeout := dur("publish-timeout", f.PublishTimeout, 100*time.Millisecond, 90*time.Second)
	statusInterval := dur("status-interval", f.StatusInterval, 10*time.Millisecond, 10*time.Second)
	pgTimeout := dur("postgres-timeout", f.PostgresTimeout, time.Second, 10*time.Minute)
	shutdownTimeout := dur("shutdown-timeout", f.ShutdownTimeout, 0, 10*time.Minute)
	standbyRetry := dur("standby-retry", f.StandbyRetry, 50*time.Millisecond, time.Minute)
	heartbeat := dur("heartbeat-interval", f.Heartbeat, 0, time.Hour)
	if heartbeat > 0 && heartbeat < time.Second {
		bad("heartbeat-interval", f.Heartbeat, "shorter than 1s", "use 0 (off) or e.g. 10s")
	}
	c.MaxOutage = dur("max-outage", f.MaxOutage, 0, 0)
	c.FinalScrapeWait = dur("final-scrape-wait", f.FinalScrape, 0, 10*time.Minute)
	c.Audit = AuditLoopConfig{Interval: dur("audit-interval", f.AuditInterval, 0, 24*time.Hour), Grace: dur("audit-grace", f.AuditGrace, 0, 24*time.Hour),
		Margin: dur("audit-margin", f.AuditMargin, 0, 24*time.Hour), PageSize: 10_000, CreatedAtColumn: f.CreatedAtColumn}
	if c.Audit.Interval > 0 && c.Audit.Interval < time.Second {
		bad("audit-interval", f.AuditInterval, "shorter than 1s", "use 0 (off) or e.g. 1h")
	}
	spec, dupWindow := f.streamSpec(bad, dur, publishTimeout, c.MaxOutage)
	monitorInterval := dur("monitor-interval", f.MonitorInterval, 100*time.Millisecond, time.Hour)
	maxRetained, err := parseBytes(f.MaxRetainedWAL)
	if err != nil {
		bad("max-retained-wal", f.MaxRetainedWAL, "not a size", "use e.g. 1GiB, or 0 to disable")
	}
	if statusInterval > 0 && pgTimeout > 0 && pgTimeout < 3*statusInterval {
		bad("postgres-timeout", f.PostgresTimeout, "shorter than 3 status intervals", "raise --postgres-timeout or lower --status-interval")
	}
	maxInFlight, err := strconv.Atoi(f.MaxInFlight)
	if err != nil || maxInFlight < 1 || maxInFlight > 100000 {
		bad("max-in-flight", f.MaxInFlight, "not a count between 1 and 100000", "use e.g. 1024")
	}
	maxCtlLine, err := strconv.Atoi(f.NatsMaxCtlLine)
	if err != nil || maxCtlLine < 256 || maxCtlLine > 1<<24 {
		bad("nats-max-control-line", f.NatsMaxCtlLine, "not a size between 256 and 16777216 bytes", "use the server's max_control_line (nats-server's default: 4096)")
	}
	maxBytes, err := parseBytes(f.MaxInFlightBytes)
	if err != nil || maxBytes < 1024 {
		bad("max-in-flight-bytes", f.MaxInFlightBytes, "not a size of at least 1KiB", "use e.g. 8MiB")
	}
	if f.Delivery != "dedup" && f.Delivery != "exactly-once" {
		bad("delivery", f.Delivery, "unknown delivery mode", "use dedup or exactly-once (see docs/guarantees.md)")
	}
	orderGuard, err := strconv.ParseBool(string(f.OrderGuard))
	if err != nil {
		bad("order-guard", string(f.OrderGuard), "not a boolean", "use true or false")
	} else if !orderGuard && f.Delivery == "exactly-once" {
		bad("order-guard", string(f.OrderGuard), "conflicts with --delivery=exactly-once (the default), which always guards the order", "drop --order-guard=false, or add --delivery=dedup (for a stream shared with other publishers)")
	}
	atomicTx, err := strconv.ParseBool(string(f.AtomicTx))
	if err != nil {
		bad("atomic-transactions", string(f.AtomicTx), "not a boolean", "use true or false")
	} else if atomicTx && f.Delivery != "exactly-once" {
		bad("atomic-transactions", string(f.AtomicTx), "needs --delivery=exactly-once: JetStream refuses a whole atomic batch that holds an id it already stored, so replays must be skipped by position, not deduplicated",
			"add --delivery=exactly-once (jetbox must then be the stream's only writer), or drop --atomic-transactions")
	}
	acceptLost, err := strconv.ParseBool(string(f.AcceptLostRows))
	if err != nil {
		bad("accept-lost-rows", string(f.AcceptLostRows), "not a boolean", "use true or false")
	}
	allowRouting, err := strconv.ParseBool(string(f.AllowRouting))
	if err != nil {
		bad("allow-routing-change", string(f.AllowRouting), "not a boolean", "use true or false")
	}
	deadLetter := ""
	switch f.OnInvalid {
	case "stop":
		if f.DeadLetterSubj != "" {
			bad("dead-letter-subject", f.DeadLetterSubj, "set while --on-invalid=stop, so never used", "add --on-invalid=dead-letter, or drop --dead-letter-subject")
		}
	case "dead-letter":
		deadLetter = f.DeadLetterSubj
		if deadLetter == "" {
			deadLetter = format.DefaultDeadLetterSubject(f.SubjectPrefix)
		}
		if err := decoder.ValidPrefix(deadLetter); err != nil {
			bad("dead-letter-subject", deadLetter, err.Error(), "use dot-separated tokens without spaces or wildcards, e.g. outbox._dlq")
		} else if rest, under := strings.CutPrefix(deadLetter, f.SubjectPrefix+"."); under && !strings.HasPrefix(rest, "_") {
			bad("dead-letter-subject", deadLetter, "inside the event subjects: it would collide with aggregate type "+strings.Split(rest, ".")[0],
				"start the token after the prefix with '_' (e.g. "+format.DefaultDeadLetterSubject(f.SubjectPrefix)+") or use a subject outside "+f.SubjectPrefix+".>")
		}
	default:
		bad("on-invalid", f.OnInvalid, "unknown policy", "use stop or dead-letter (see docs/guarantees.md)")
	}
	level, err := zerolog.ParseLevel(f.LogLevel)
	if err != nil || f.LogLevel == "" {
		bad("log-level", f.LogLevel, "unknown level", "use debug, info, warn or error")
	}
	if f.LogFormat != "json" && f.LogFormat != "console" {
		bad("log-format", f.LogFormat, "unknown format", "use json or console")
	}
	if c.Audit.Interval > 0 && !fromTable {
		bad("audit-interval", f.AuditInterval, "the audit compares the outbox table's rows with the stream, and --source=messages has no table",
			"drop --audit-interval (0), or audit a table source")
	}
	if len(errs) > 0 {
		return Config{}, errors.Join(errs...)
	}

	if !fromTable {
		schema, table = "", "" // no table: the decoder publishes no rows
	}
	filter := f.SubjectPrefix + ".*.*" // the default template's subjects
	if subjects != nil {
		filter = subjects.Filter(f.SubjectPrefix)
	}
	c.Replication = replication.Config{
		Slot: f.Slot, Publication: f.Publication,
		Decoder: decoder.Config{Schema: schema, Table: table, Columns: cols, SubjectPrefix: f.SubjectPrefix, DeadLetterSubject: deadLetter,
			Subjects: subjects, MessagePrefix: messagePrefix, Atomic: atomicTx},
		StatusInterval:     statusInterval,
		Timeout:            pgTimeout,
		MaxInFlight:        maxInFlight,
		MaxInFlightBytes:   maxBytes,
		ShutdownTimeout:    shutdownTimeout,
		StandbyRetry:       standbyRetry,
		HeartbeatInterval:  heartbeat,
		MaxRetainedWAL:     int64(maxRetained),
		MonitorInterval:    monitorInterval,
		AcceptLostRows:     acceptLost,
		AllowRoutingChange: allowRouting,
	}
	c.Sink = sink.Config{Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, DuplicateWindow: dupWindow, StreamSpec: spec,
		PublishTimeout: publishTimeout, MaxPending: maxInFlight, MaxControlLine: maxCtlLine, OrderGuard: orderGuard, ExactlyOnce: f.Delivery == "exactly-once", DeadLetterSubject: deadLetter,
		AtomicTransactions: atomicTx, SubjectFilter: filter, SubjectsHoldIDs: subjects != nil && subjects.UsesAggregateID(),
		IndexScheme: c.Replication.Decoder.IndexScheme(), JSDomain: n.JSDomain, Routing: c.Replication.Decoder.RoutingHeader()}
	c.LogLevel, c.LogConsole = level, f.LogFormat == "console"
	return c, nil
}

// streamSpec reads the --stream-* flags and --duplicate-window: what a
// stream jetbox creates gets, and which settings were given (compared with
// an existing stream). Empty, or auto where there is a choice, is the default.
func (f *RunFlags) streamSpec(bad func(flag, value, problem, fix string), dur func(flag, v string, min, max time.Duration) time.Duration,
	publishTimeout, maxOutage time.Duration) (sink.StreamSpec, time.Duration) {
	sp := sink.StreamSpec{Given: map[string]bool{}, MaxBytes: -1, MaxMsgs: -1}
	given := func(key, v string) bool {
		if v == "" || v == "auto" {
			return false
		}
		sp.Given[key] = true
		return true
	}
	if given("replicas", f.StreamReplicas) {
		n, err := strconv.Atoi(f.StreamReplicas)
		if err != nil || n < 1 || n > 5 {
			bad("stream-replicas", f.StreamReplicas, "not a replica count between 1 and 5", "use auto (3 on a cluster, 1 on a single server), 1 or 3")
		}
		sp.Replicas = n
	}
	if given("max-age", f.StreamMaxAge) {
		sp.MaxAge = dur("stream-max-age", f.StreamMaxAge, 0, 0)
		if sp.MaxAge > 0 && sp.MaxAge < time.Second {
			bad("stream-max-age", f.StreamMaxAge, "shorter than 1s", "use 0 (no max age) or e.g. 168h")
		} else if sp.MaxAge > 0 && f.Delivery != "dedup" && sp.MaxAge < maxOutage {
			bad("stream-max-age", f.StreamMaxAge, fmt.Sprintf("shorter than --max-outage %s: exactly-once resumes from the stream's last message, which this max age expires during such an outage", maxOutage),
				"drop --stream-max-age (no max age), keep it far above --max-outage, or add --delivery=dedup")
		}
	}
	count := func(flag, key, v string, size bool) int64 {
		if !given(key, v) {
			return -1
		}
		if v == "-1" || v == "0" {
			return -1
		}
		if size {
			n, err := parseBytes(v)
			if err != nil || n < 1024 {
				bad(flag, v, "not a size of at least 1KiB", "use e.g. 50GiB, or -1 for no limit")
			}
			return int64(n)
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 1 {
			bad(flag, v, "not a message count", "use e.g. 10000000, or -1 for no limit")
		}
		return n
	}
	sp.MaxBytes = count("stream-max-bytes", "max-bytes", f.StreamMaxBytes, true)
	sp.MaxMsgs = count("stream-max-msgs", "max-msgs", f.StreamMaxMsgs, false)
	if given("storage", f.StreamStorage) {
		switch f.StreamStorage {
		case "file":
		case "memory":
			sp.Storage = jetstream.MemoryStorage
		default:
			bad("stream-storage", f.StreamStorage, "unknown storage", "use file or memory")
		}
	}
	if given("discard", f.StreamDiscard) {
		switch f.StreamDiscard {
		case "old":
		case "new":
			sp.Discard = jetstream.DiscardNew
		default:
			bad("stream-discard", f.StreamDiscard, "unknown discard policy", "use old or new")
		}
	}
	var window time.Duration
	if given("duplicate-window", f.DuplicateWindow) {
		window = dur("duplicate-window", f.DuplicateWindow, time.Second, 0)
		if sp.MaxAge > 0 && window > sp.MaxAge {
			bad("duplicate-window", f.DuplicateWindow, fmt.Sprintf("longer than --stream-max-age %s (JetStream refuses it)", sp.MaxAge), "use a window no longer than the max age")
		}
	} else {
		window = sink.DuplicateWindowFor(f.Delivery != "dedup", publishTimeout, maxOutage)
		if sp.MaxAge > 0 && window > sp.MaxAge {
			window = sp.MaxAge // as JetStream caps it
		}
	}
	return sp, window
}

func envName(flag string) string {
	return "JETBOX_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// parseBytes reads sizes such as 1048576, 512KiB, 16MiB, 1GiB or 2TiB (up to 1 PiB).
func parseBytes(s string) (int, error) {
	mult := 1
	for _, u := range []struct {
		suffix string
		mult   int
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 0 || n > (1<<50)/mult {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	return n * mult, nil
}

var passwordInURL = regexp.MustCompile(`(://[^:/@]*:)[^@]*@`)

// redact hides passwords that parse errors may echo.
func redact(s string) string {
	s = passwordInURL.ReplaceAllString(s, "${1}xxxxx@")
	return regexp.MustCompile(`password=\S+`).ReplaceAllString(s, "password=xxxxx")
}
