package redisenv_test

import (
	"context"
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// vars are the variables Load reads; each case starts with all of them unset.
var vars = []string{"REDIS_ADDR", "REDIS_MASTER_NAME", "REDIS_PASSWORD", "REDIS_DB"}

// setEnv unsets every variable in vars, then sets env, restoring all at cleanup.
func setEnv(t *testing.T, env map[string]string) {
	t.Helper()
	for _, k := range vars {
		t.Setenv(k, "") // registers the restore
		if err := os.Unsetenv(k); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range env {
		t.Setenv(k, v)
	}
}

func TestLoad(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		want    redisenv.Config
		wantErr string // exact error text; empty means no error
	}{
		{
			name: "Defaults",
			want: redisenv.Config{Addr: "127.0.0.1:6379"},
		},
		{
			name: "SingleNodeAllSet",
			env:  map[string]string{"REDIS_ADDR": "redis.internal:6380", "REDIS_PASSWORD": "s3cret", "REDIS_DB": "3"},
			want: redisenv.Config{Addr: "redis.internal:6380", Password: "s3cret", DB: 3},
		},
		{
			name: "ClusterList",
			env:  map[string]string{"REDIS_ADDR": "10.0.0.1:7000, 10.0.0.2:7001,10.0.0.3:7002"},
			want: redisenv.Config{Addr: "10.0.0.1:7000, 10.0.0.2:7001,10.0.0.3:7002"},
		},
		{
			name: "SentinelWithDB",
			env:  map[string]string{"REDIS_ADDR": "s1:26379,s2:26379", "REDIS_MASTER_NAME": "mymaster", "REDIS_DB": "2"},
			want: redisenv.Config{Addr: "s1:26379,s2:26379", MasterName: "mymaster", DB: 2},
		},
		{
			name: "IPv6",
			env:  map[string]string{"REDIS_ADDR": "[::1]:6379"},
			want: redisenv.Config{Addr: "[::1]:6379"},
		},
		{
			name:    "BadDB",
			env:     map[string]string{"REDIS_DB": "abc"},
			wantErr: `redisenv: REDIS_DB="abc": not an integer`,
		},
		{
			name:    "DBOutOfRange",
			env:     map[string]string{"REDIS_DB": "99999999999999999999"},
			wantErr: `redisenv: REDIS_DB="99999999999999999999": integer out of range`,
		},
		{
			name:    "NegativeDB",
			env:     map[string]string{"REDIS_DB": "-1"},
			wantErr: `redisenv: REDIS_DB="-1": must be at least 0`,
		},
		{
			name:    "ClusterWithDB",
			env:     map[string]string{"REDIS_ADDR": "a:7000,b:7001", "REDIS_DB": "1"},
			wantErr: `redisenv: REDIS_DB="1": Redis Cluster (REDIS_ADDR lists 2 nodes) has only database 0`,
		},
		{
			name:    "AddrMissingPort",
			env:     map[string]string{"REDIS_ADDR": "localhost"},
			wantErr: `redisenv: REDIS_ADDR="localhost": "localhost" is not host:port: missing port in address`,
		},
		{
			name:    "AddrPortNotNumeric",
			env:     map[string]string{"REDIS_ADDR": "localhost:redis"},
			wantErr: `redisenv: REDIS_ADDR="localhost:redis": "localhost:redis" is not host:port: port "redis" is not a number in 1-65535`,
		},
		{
			name:    "AddrPortZero",
			env:     map[string]string{"REDIS_ADDR": "localhost:0"},
			wantErr: `redisenv: REDIS_ADDR="localhost:0": "localhost:0" is not host:port: port "0" is not a number in 1-65535`,
		},
		{
			name:    "AddrMissingHost",
			env:     map[string]string{"REDIS_ADDR": ":6379"},
			wantErr: `redisenv: REDIS_ADDR=":6379": ":6379" is not host:port: missing host`,
		},
		{
			name:    "AddrSetEmpty",
			env:     map[string]string{"REDIS_ADDR": ""},
			wantErr: `redisenv: REDIS_ADDR="": empty address`,
		},
		{
			name:    "BadAddrInClusterList",
			env:     map[string]string{"REDIS_ADDR": "a:7000,b,c:7002"},
			wantErr: `redisenv: REDIS_ADDR="a:7000,b,c:7002": "b" is not host:port: missing port in address`,
		},
		{
			name:    "EmptyEntryInClusterList",
			env:     map[string]string{"REDIS_ADDR": "a:7000,,c:7002"},
			wantErr: `redisenv: REDIS_ADDR="a:7000,,c:7002": empty address`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { // no t.Parallel: t.Setenv
			setEnv(t, tc.env)
			got, err := redisenv.Load()
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("Load() error = %v, want %s", err, tc.wantErr)
				}
				if got != (redisenv.Config{}) {
					t.Errorf("Load() on error returned %+v, want the zero Config", got)
				}
				return
			}
			if err != nil {
				t.Fatalf("Load() error = %v", err)
			}
			if got != tc.want {
				t.Errorf("Load() = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestConfig_UniversalOptions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  redisenv.Config
		want redis.UniversalOptions
	}{
		{
			name: "SingleNode",
			cfg:  redisenv.Config{Addr: "127.0.0.1:6379", Password: "pw", DB: 4},
			want: redis.UniversalOptions{Addrs: []string{"127.0.0.1:6379"}, Password: "pw", DB: 4},
		},
		{
			name: "ClusterTrimsSpaces",
			cfg:  redisenv.Config{Addr: "a:7000 , b:7001"},
			want: redis.UniversalOptions{Addrs: []string{"a:7000", "b:7001"}},
		},
		{
			name: "Sentinel",
			cfg:  redisenv.Config{Addr: "s1:26379,s2:26379", MasterName: "mymaster", DB: 1},
			want: redis.UniversalOptions{Addrs: []string{"s1:26379", "s2:26379"}, MasterName: "mymaster", DB: 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := tc.cfg.UniversalOptions(); !reflect.DeepEqual(*got, tc.want) {
				t.Errorf("UniversalOptions() = %+v, want %+v", *got, tc.want)
			}
		})
	}
}

func TestConfig_NewClient(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  redisenv.Config
		want string // client type
	}{
		{name: "SingleNode", cfg: redisenv.Config{Addr: "127.0.0.1:6379"}, want: "*redis.Client"},
		{name: "Cluster", cfg: redisenv.Config{Addr: "a:7000,b:7001"}, want: "*redis.ClusterClient"},
		{name: "Sentinel", cfg: redisenv.Config{Addr: "s1:26379", MasterName: "mymaster"}, want: "*redis.Client"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := tc.cfg.NewClient()
			defer c.Close()
			if got := reflect.TypeOf(c).String(); got != tc.want {
				t.Errorf("NewClient() is a %s, want %s", got, tc.want)
			}
		})
	}
}

func TestConfig_String_hidesPassword(t *testing.T) {
	t.Parallel()
	c := redisenv.Config{Addr: "a:1", Password: "s3cret", DB: 2}
	got := c.String()
	want := `REDIS_ADDR="a:1" REDIS_MASTER_NAME="" REDIS_PASSWORD=<set> REDIS_DB=2`
	if got != want {
		t.Errorf("String() = %s, want %s", got, want)
	}
	if strings.Contains(got, "s3cret") {
		t.Errorf("String() reveals the password: %s", got)
	}
}

// TestConfig_NewClient_sentinel: with REDIS_ADDR listing the sentinels of a running
// deployment (redistest.StartSentinel) and REDIS_MASTER_NAME its master name, Load and
// NewClient give a client that Ping finds answering and that writes to the primary, in the
// REDIS_DB database; the write reaches the replica. Ping says what is wrong otherwise: a
// master name no Sentinel knows, Sentinels that do not answer, a master that does not.
func TestConfig_NewClient_sentinel(t *testing.T) {
	s := redistest.StartSentinel(t)
	ctx := context.Background()
	sentinels := strings.Join(s.Addrs, ",")
	load := func(env map[string]string) (redisenv.Config, redis.UniversalClient) {
		t.Helper()
		setEnv(t, env)
		cfg, err := redisenv.Load()
		if err != nil {
			t.Fatal(err)
		}
		rdb := cfg.NewClient()
		t.Cleanup(func() { _ = rdb.Close() })
		return cfg, rdb
	}

	cfg, rdb := load(map[string]string{"REDIS_ADDR": sentinels, "REDIS_MASTER_NAME": "mymaster", "REDIS_DB": "3"})
	if err := cfg.Ping(ctx, rdb); err != nil {
		t.Fatalf("Ping through %s: %v", cfg, err)
	}
	if err := rdb.Set(ctx, "greeting", "hello", 0).Err(); err != nil {
		t.Fatalf("SET through %s: %v", cfg, err)
	}
	if n, err := rdb.Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Errorf("WAIT 1 5000 = %d, %v; want 1 replica", n, err)
	}
	for name, srv := range map[string]*redistest.Server{"primary": s.Primary, "replica": s.Replica} {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, DB: 3})
		if got, err := c.Get(ctx, "greeting").Result(); err != nil || got != "hello" {
			t.Errorf("GET greeting in database 3 of the %s = %q, %v; want hello", name, got, err)
		}
		if n, err := srv.Client().DBSize(ctx).Result(); err != nil || n != 0 {
			t.Errorf("database 0 of the %s holds %d keys, %v; want none", name, n, err)
		}
		_ = c.Close()
	}

	cfg, rdb = load(map[string]string{"REDIS_ADDR": sentinels, "REDIS_MASTER_NAME": "nosuch"})
	want := `redisenv: no Sentinel in REDIS_ADDR="` + sentinels + `" knows REDIS_MASTER_NAME="nosuch"`
	if err := cfg.Ping(ctx, rdb); err == nil || err.Error() != want {
		t.Errorf("Ping with an unknown master name: %v\nwant %s", err, want)
	}

	down := redistest.StartServer(t)
	down.Stop()
	cfg, rdb = load(map[string]string{"REDIS_ADDR": down.Addr, "REDIS_MASTER_NAME": "mymaster"})
	want = `redisenv: no Sentinel in REDIS_ADDR="` + down.Addr + `" answers: ` + down.Addr + `: dial tcp ` + down.Addr + `: connect: connection refused`
	// go-redis's failover client retries its dials for half a minute: a command's own
	// deadline ends that, as cmd/worker's does at start; Ping's questions to the
	// Sentinels have their own.
	pingCtx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if err := cfg.Ping(pingCtx, rdb); err == nil || err.Error() != want {
		t.Errorf("Ping with no Sentinel up: %v\nwant %s", err, want)
	}

	// Without a replica to promote, the sentinels keep naming the dead primary.
	s.Replica.Stop()
	s.Primary.Stop()
	cfg, rdb = load(map[string]string{"REDIS_ADDR": s.Addrs[0], "REDIS_MASTER_NAME": "mymaster"})
	want = `redisenv: the master of REDIS_MASTER_NAME="mymaster" at ` + s.Primary.Addr + ` (says Sentinel ` + s.Addrs[0] + `) does not answer: `
	pingCtx, cancel = context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if err := cfg.Ping(pingCtx, rdb); err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Errorf("Ping with the master down: %v\nwant %s...", err, want)
	}
}

// TestConfig_Ping: against a real redis-server (16 databases), REDIS_DB=15 answers, and
// REDIS_DB=99 is an ErrNoSuchDB error that names the variable and quotes its value; an
// unreachable Redis is not; a list of addresses of a Redis that is not a cluster says
// what a list means.
func TestConfig_Ping(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	ctx := context.Background()
	ping := func(c redisenv.Config) error {
		rdb := c.NewClient()
		defer rdb.Close()
		return c.Ping(ctx, rdb)
	}
	if err := ping(redisenv.Config{Addr: srv.Addr, DB: 15}); err != nil {
		t.Errorf("REDIS_DB=15: %v", err)
	}
	err := ping(redisenv.Config{Addr: srv.Addr, DB: 99})
	want := `redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="` + srv.Addr + `" has no database 99 (ERR DB index is out of range); ` +
		`it has databases 0 to N-1, N its "databases" setting (16 by default)`
	if err == nil || err.Error() != want || !errors.Is(err, redisenv.ErrNoSuchDB) {
		t.Errorf("REDIS_DB=99: %v\nwant %s (ErrNoSuchDB)", err, want)
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		t.Errorf("REDIS_DB=99: %v does not wrap Redis's error", err)
	}
	down := redistest.StartServer(t)
	down.Stop()
	if err := ping(redisenv.Config{Addr: down.Addr}); err == nil || errors.Is(err, redisenv.ErrNoSuchDB) {
		t.Errorf("Redis down: %v, want an error that is not ErrNoSuchDB", err)
	}
	// Two addresses of a Redis that is not a cluster: say what a list means.
	list := srv.Addr + "," + srv.Addr
	err = ping(redisenv.Config{Addr: list})
	want = `redisenv: REDIS_ADDR="` + list + `" lists 2 addresses, which means Redis Cluster nodes (or Sentinels, with REDIS_MASTER_NAME), ` +
		`but the Redis there is not in cluster mode (ERR This instance has cluster support disabled): give one address for a single Redis`
	if err == nil || err.Error() != want || !errors.Is(err, redisenv.ErrNotCluster) || errors.Is(err, redisenv.ErrNoSuchDB) {
		t.Errorf("a list of standalone servers: %v\nwant %s (ErrNotCluster, not ErrNoSuchDB)", err, want)
	}
}

// TestConfig_Ping_auth: a Redis that requires a password refuses a connection without
// one (NOAUTH) or with a wrong one (WRONGPASS); Ping says so as a bad REDIS_PASSWORD
// (ErrAuth, a bad value: commands exit 2), not as a Redis that does not answer, and
// answers with the right one.
func TestConfig_Ping_auth(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	ctx := context.Background()
	admin := srv.Client()
	if err := admin.ConfigSet(ctx, "requirepass", "s3cret").Err(); err != nil {
		t.Fatal(err)
	}
	ping := func(c redisenv.Config) error {
		rdb := c.NewClient()
		defer rdb.Close()
		return c.Ping(ctx, rdb)
	}
	for _, c := range []struct{ password, want string }{
		{"", `redisenv: REDIS_PASSWORD: the Redis at REDIS_ADDR="` + srv.Addr + `" answered but refused the credentials ` +
			`(REDIS_PASSWORD is empty): NOAUTH Authentication required.`},
		{"wrong", `redisenv: REDIS_PASSWORD: the Redis at REDIS_ADDR="` + srv.Addr + `" answered but refused the credentials ` +
			`(REDIS_PASSWORD is set, but not the Redis's password): WRONGPASS invalid username-password pair or user is disabled.`},
	} {
		err := ping(redisenv.Config{Addr: srv.Addr, Password: c.password})
		if err == nil || err.Error() != c.want || !errors.Is(err, redisenv.ErrAuth) || !redisenv.IsBadValue(err) {
			t.Errorf("REDIS_PASSWORD=%q: %v\nwant %s (ErrAuth, a bad value)", c.password, err, c.want)
		}
	}
	if err := ping(redisenv.Config{Addr: srv.Addr, Password: "s3cret"}); err != nil {
		t.Errorf("the right REDIS_PASSWORD: %v", err)
	}
}

// TestConfig_Ping_clusterNode: one address of a Redis Cluster node is refused as a bad
// value (ErrClusterNode), naming what to give instead: a single-node client would send
// every key there and get MOVED for the keys of other nodes' slots (a trial's cmd/worker
// started so and logged MOVED errors). All the primaries, comma separated, are accepted.
func TestConfig_Ping_clusterNode(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	ctx := context.Background()
	ping := func(c redisenv.Config) error {
		rdb := c.NewClient()
		defer rdb.Close()
		return c.Ping(ctx, rdb)
	}
	one := cluster.Addrs[1]
	err := ping(redisenv.Config{Addr: one})
	want := `redisenv: REDIS_ADDR="` + one + `" is one node of a Redis Cluster (INFO cluster: cluster_enabled:1): list its primaries, ` +
		`comma separated, so that the client follows the cluster's slots; one address is taken as a single Redis, and every key ` +
		`another node serves would fail with MOVED`
	if err == nil || err.Error() != want || !errors.Is(err, redisenv.ErrClusterNode) || !redisenv.IsBadValue(err) {
		t.Errorf("one cluster node: %v\nwant %s (ErrClusterNode, a bad value)", err, want)
	}
	if err := ping(redisenv.Config{Addr: strings.Join(cluster.Addrs, ",")}); err != nil {
		t.Errorf("the primaries: %v, want nil", err)
	}
}
