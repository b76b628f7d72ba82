// Package k8s holds rlagent's Kubernetes integration tests: a real
// kube-apiserver and etcd (internal/k8stest), driven through client-go, and
// the real rlagent binary as three agents on three simulated nodes. No fake
// clientset, no mocks.
//
// A simulated node is a pair of network namespaces joined by veth, as in
// test/e2e: the agent runs in B with its own NODE_NAME (--node-name), its
// own config file and its own pin directory on a private bpffs, and reaches
// the API server on B's loopback at the address in the kubeconfig, through a
// TCP forwarder the test runs into the host's loopback (the API server
// listens there only); while a test has the API server stopped, the
// forwarder refuses connections, as a real node would meet them. A
// Service's endpoint addresses live on B's veth; senders in A reach them
// through a route.
//
// Latencies. When a change reached a node is measured two ways: when the
// agent rewrote its maps, from the timestamp of its "limit set" or "limit
// removed" log line (written right after the map update), and when the
// test, polling the node's maps as `rlagent status` reads them, first saw
// the new share. Each is measured from just before the API request that
// made the change.
//
// Every test but TestAPIServerOutage shares one API server (k8stest.Shared)
// and keeps apart by namespace and by RateLimit name; RateLimits are
// cluster-scoped, so each test deletes its own in Cleanup and stops its
// agents before the next test starts. TestAPIServerOutage stops its API
// server for 30 s and so has one of its own.
//
// The tests that run agents need root and skip without it (fail with
// RLAGENT_REQUIRE_ROOT_TESTS=1); the schema and deploy/ tests do not. They
// run one after another: the latencies and rates they measure need the
// machine's two CPUs.
package k8s
