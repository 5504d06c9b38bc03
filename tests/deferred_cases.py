"""Training loops shaped as public TF1 programs (shrunk), each run as written and under
``ms.deferred``: the worker of tests/test_deferred.py, run in a subprocess per preamble.

``python tests/deferred_cases.py PREAMBLE [CASE ...]`` prints one JSON line a case: whether
every variable at the end and every value the loop read are bitwise those of the loop as
written, and the deferred session's report (steps, compiled runs). Each case is a function
``case(session)``: it builds its graph, makes its session with ``session(graph)`` (a plain
``tf.compat.v1.Session``, or the same deferred) and runs its loop as the program does,
returning (the variables' values at the end, the values the loop read, in order).
"""

import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if __name__ == "__main__":
    getattr(tf.compat.v1, sys.argv[1])()

import multistep as ms  # noqa: E402
from multistep.loops import payback  # noqa: E402

v1 = tf.compat.v1
STEPS = 4  # N of the deferred session in every case


def _variables(sess):
    with sess.graph.as_default():
        return {v.op.name: sess.run(v) for v in v1.global_variables()}


def _fresh_folder(name):
    """An empty folder of a fixed path (the same in every run of the cases)."""
    folder = os.path.join(tempfile.gettempdir(), "multistep_deferred_cases", name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def _dense(x, units, name, activation=None):
    w = v1.get_variable(f"{name}/w", [x.shape[-1], units],
                        initializer=v1.glorot_uniform_initializer())
    b = v1.get_variable(f"{name}/b", [units], initializer=v1.zeros_initializer())
    y = tf.matmul(x, w) + b
    return activation(y) if activation else y


def case_svd(session):
    """An SVD recommender (sparse Adam on embeddings) that evaluates the test set at step 0
    of every epoch and accumulates its squared errors with numpy, lazily."""
    rng = np.random.RandomState(0)
    users, items = rng.randint(0, 30, 240), rng.randint(0, 20, 240)
    rates = rng.uniform(1, 5, 240).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        u = v1.placeholder(tf.int32, [None], name="u")
        i = v1.placeholder(tf.int32, [None], name="i")
        r = v1.placeholder(tf.float32, [None], name="r")
        pu = v1.get_variable("pu", [30, 5], initializer=v1.truncated_normal_initializer(0, .1))
        qi = v1.get_variable("qi", [20, 5], initializer=v1.truncated_normal_initializer(0, .1))
        pred = tf.reduce_sum(tf.nn.embedding_lookup(pu, u) * tf.nn.embedding_lookup(qi, i), 1) + 3
        cost = tf.nn.l2_loss(pred - r)
        train = v1.train.AdamOptimizer(0.05).minimize(cost)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads = []
    for epoch in range(3):
        errors = []
        for step in range(6):
            lo = step * 32
            if step == 0:  # the test set, on the weights of this point of the loop
                test = sess.run(pred, {u: users[200:], i: items[200:]})
                reads.append(np.sqrt(np.mean(np.power(test - rates[200:], 2))))
            feed = {u: users[lo:lo + 32], i: items[lo:lo + 32], r: rates[lo:lo + 32]}
            _, pred_batch = sess.run([train, pred], feed)
            errors.append(np.power(pred_batch - rates[lo:lo + 32], 2))  # stays lazy
        reads.append(np.sqrt(np.mean(errors)))  # a read: runs the pending steps
    return _variables(sess), reads, sess


def case_ppo(session):
    """PPO: actions sampled between updates, then `update_oldpi`, then A actor steps and C
    critic steps (two optimizers, alternating programs)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(2)
        s = v1.placeholder(tf.float32, [None, 3], "state")
        a = v1.placeholder(tf.float32, [None, 1], "action")
        adv = v1.placeholder(tf.float32, [None, 1], "advantage")
        ret = v1.placeholder(tf.float32, [None, 1], "discounted_r")
        with v1.variable_scope("critic"):
            v = _dense(_dense(s, 8, "l1", tf.nn.relu), 1, "v")
            closs = tf.reduce_mean(tf.square(ret - v))
            ctrain = v1.train.AdamOptimizer(0.01).minimize(closs)
        def policy(name, trainable):
            with v1.variable_scope(name):
                h = _dense(s, 8, "l1", tf.nn.relu)
                mu, sigma = _dense(h, 1, "mu", tf.tanh), _dense(h, 1, "sigma", tf.nn.softplus) + .1
            params = v1.get_collection(v1.GraphKeys.GLOBAL_VARIABLES, scope=name)
            return mu, sigma, params
        mu, sigma, pi_params = policy("pi", True)
        old_mu, old_sigma, old_params = policy("oldpi", False)
        sample = mu + sigma * v1.random_normal(tf.shape(mu), seed=3)
        update_oldpi = [o.assign(p) for p, o in zip(pi_params, old_params)]
        def logp(m, sg):
            return -tf.square(a - m) / (2 * tf.square(sg)) - tf.math.log(sg)
        ratio = tf.exp(logp(mu, sigma) - tf.stop_gradient(logp(old_mu, old_sigma)))
        aloss = -tf.reduce_mean(tf.minimum(ratio * adv, tf.clip_by_value(ratio, .8, 1.2) * adv))
        atrain = v1.train.AdamOptimizer(0.01).minimize(aloss, var_list=pi_params)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    rng = np.random.RandomState(1)
    reads = []
    state = rng.randn(1, 3).astype(np.float32)
    for episode in range(2):
        buffer_s, buffer_a = [], []
        for t in range(6):
            action = sess.run(sample, {s: state})[0]
            buffer_s.append(state[0]); buffer_a.append(action)
            state = (state + 0.1 * rng.randn(1, 3)).astype(np.float32)
        bs, ba = np.array(buffer_s), np.array(buffer_a)
        br = rng.randn(6, 1).astype(np.float32)
        sess.run(update_oldpi)
        advantage = br - sess.run(v, {s: bs})
        reads.append(advantage)
        for _ in range(5):
            sess.run(atrain, {s: bs, a: ba, adv: advantage})
        for _ in range(5):
            sess.run(ctrain, {s: bs, ret: br})
    return _variables(sess), reads, sess


def case_mlp(session):
    """The feed-a-call MLP tutorial: avg_cost += c / total_batch, accuracy every
    display_step epochs."""
    rng = np.random.RandomState(3)
    data_x = rng.randn(60, 6).astype(np.float32)
    data_y = np.eye(3, dtype=np.float32)[rng.randint(0, 3, 60)]
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(4)
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.float32, [None, 3])
        logits = _dense(_dense(x, 16, "h1", tf.nn.relu), 3, "out")
        cost = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
        optimizer = v1.train.RMSPropOptimizer(0.01).minimize(cost)
        correct = tf.equal(tf.argmax(logits, 1), tf.argmax(y, 1))
        accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads, total_batch = [], 6
    for epoch in range(4):
        avg_cost = 0.
        for i in range(total_batch):
            batch_x, batch_y = data_x[i * 10:(i + 1) * 10], data_y[i * 10:(i + 1) * 10]
            _, c = sess.run([optimizer, cost], feed_dict={x: batch_x, y: batch_y})
            avg_cost += c / total_batch
        if epoch % 2 == 0:
            reads.append("Epoch: %04d cost= %.9f" % (epoch + 1, avg_cost))
            with sess.as_default():  # the tutorial's accuracy.eval()
                reads.append(accuracy.eval({x: data_x, y: data_y}))
    return _variables(sess), reads, sess


def case_ptb(session):
    """A PTB-style RNN whose final state is fed back as the next step's initial state
    (a computed tensor, as cell.zero_state's), reset each epoch."""
    rng = np.random.RandomState(5)
    words = rng.randint(0, 10, (2, 9, 4, 3))  # epochs, steps, batch, time
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(6)
        inputs = v1.placeholder(tf.int32, [4, 3])
        targets = v1.placeholder(tf.int32, [4, 3])
        embedding = v1.get_variable("embedding", [10, 6])
        cell_w = v1.get_variable("cell_w", [12, 6])
        initial_state = tf.zeros([4, 6])
        state, outputs = initial_state, []
        for t in range(3):
            x = tf.nn.embedding_lookup(embedding, inputs[:, t])
            state = tf.tanh(tf.matmul(tf.concat([x, state], 1), cell_w))
            outputs.append(state)
        final_state = state
        logits = _dense(tf.reshape(tf.stack(outputs, 1), [-1, 6]), 10, "softmax")
        cost = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(targets, [-1]), logits=logits))
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(cost)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads = []
    for epoch in range(2):
        costs, state_value = 0.0, sess.run(initial_state)
        for step in range(9):
            cost_value, state_value, _ = sess.run(
                [cost, final_state, train_op],
                {inputs: words[epoch, step], targets: (words[epoch, step] + 1) % 10,
                 initial_state: state_value})
            costs += cost_value
        reads.append(np.exp(costs / 9))
    return _variables(sess), reads, sess


def case_data(session):
    """A tf.data loop that runs until the input ends (OutOfRangeError), counting its steps."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(7)
        rng = np.random.RandomState(7)
        data = tf.data.Dataset.from_tensor_slices(
            (rng.randn(40, 5).astype(np.float32), rng.randn(40, 1).astype(np.float32)))
        x, y = v1.data.make_one_shot_iterator(data.batch(4)).get_next()
        loss = tf.reduce_mean(tf.square(_dense(x, 1, "lin") - y))
        step = v1.train.get_or_create_global_step()
        train = v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    made = 0
    while True:
        try:
            sess.run(train)
        except tf.errors.OutOfRangeError:
            break
        made += 1
    return _variables(sess), [sess.run(step), made], sess


def case_checkpoint(session):
    """Saves every 3 steps; a second graph restores the last checkpoint and trains on."""
    folder = _fresh_folder("checkpoint")  # (one path: Saver.save returns it, and
    #                                        `multistep verify` compares what runs return)
    rng = np.random.RandomState(8)
    xs, ys = rng.randn(10, 4, 3).astype(np.float32), rng.randn(10, 4, 1).astype(np.float32)

    def build():
        graph = tf.Graph()
        with graph.as_default():
            v1.set_random_seed(9)
            x = v1.placeholder(tf.float32, [None, 3])
            y = v1.placeholder(tf.float32, [None, 1])
            loss = tf.reduce_mean(tf.square(_dense(x, 1, "lin") - y))
            step = v1.train.get_or_create_global_step()
            train = v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
            return graph, x, y, train, v1.train.Saver(), v1.global_variables_initializer()

    graph, x, y, train, saver, init = build()
    sess = session(graph)
    sess.run(init)
    for i in range(7):
        sess.run(train, {x: xs[i], y: ys[i]})
        if (i + 1) % 3 == 0:
            saver.save(sess, os.path.join(folder, "model"), global_step=i + 1)
    sess.close()
    graph, x, y, train, saver, init = build()
    sess = session(graph)
    saver.restore(sess, v1.train.latest_checkpoint(folder))
    for i in range(6, 10):
        sess.run(train, {x: xs[i], y: ys[i]})
    saved = v1.train.load_checkpoint(v1.train.latest_checkpoint(folder))
    reads = [saved.get_tensor(name) for name in sorted(saved.get_variable_to_shape_map())]
    return _variables(sess), reads, sess


def case_summary(session):
    """A summary fetched with the train op and written every step."""
    folder = _fresh_folder("summary")
    rng = np.random.RandomState(10)
    xs, ys = rng.randn(10, 4, 3).astype(np.float32), rng.randn(10, 4, 1).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(11)
        x = v1.placeholder(tf.float32, [None, 3])
        y = v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean(tf.square(_dense(x, 1, "lin") - y))
        v1.summary.scalar("loss", loss)
        merged = v1.summary.merge_all()
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = v1.global_variables_initializer()
    sess = session(graph)
    writer = v1.summary.FileWriter(folder)
    sess.run(init)
    for i in range(10):
        summary, _ = sess.run([merged, train], {x: xs[i], y: ys[i]})
        writer.add_summary(summary, i)
    writer.close()
    events = [(e.step, v.tag, v.simple_value)
              for path in sorted(os.listdir(folder))
              for e in v1.train.summary_iterator(os.path.join(folder, path))
              for v in e.summary.value]
    return _variables(sess), events, sess


def case_gan(session):
    """A WGAN-style loop: 3 critic steps, then one generator step (two train ops)."""
    rng = np.random.RandomState(12)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(13)
        z = v1.placeholder(tf.float32, [None, 2])
        real = v1.placeholder(tf.float32, [None, 2])
        with v1.variable_scope("g"):
            fake = _dense(_dense(z, 8, "l1", tf.nn.relu), 2, "out")
        with v1.variable_scope("d"):
            d_real = _dense(_dense(real, 8, "l1", tf.nn.relu), 1, "out")
        with v1.variable_scope("d", reuse=True):
            d_fake = _dense(_dense(fake, 8, "l1", tf.nn.relu), 1, "out")
        d_loss = tf.reduce_mean(d_fake) - tf.reduce_mean(d_real)
        g_loss = -tf.reduce_mean(d_fake)
        d_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "d")
        g_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "g")
        d_train = v1.train.RMSPropOptimizer(5e-3).minimize(d_loss, var_list=d_vars)
        g_train = v1.train.RMSPropOptimizer(5e-3).minimize(g_loss, var_list=g_vars)
        clip = [p.assign(tf.clip_by_value(p, -0.1, 0.1)) for p in d_vars]
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads = []
    for it in range(3):
        for _ in range(3):
            _, dl = sess.run([d_train, d_loss], {z: rng.randn(8, 2), real: rng.randn(8, 2) + 2})
            sess.run(clip)
        _, gl = sess.run([g_train, g_loss], {z: rng.randn(8, 2)})
        reads.append((dl, gl))
    return _variables(sess), [float(a) for r in reads for a in r], sess


def case_critic_steps(session):
    """A GAN whose loop makes 4 critic steps (fused), then one generator step."""
    rng = np.random.RandomState(14)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(15)
        z = v1.placeholder(tf.float32, [None, 2])
        real = v1.placeholder(tf.float32, [None, 2])
        with v1.variable_scope("g"):
            fake = _dense(z, 2, "out")
        with v1.variable_scope("d"):
            d_real = _dense(real, 1, "out", tf.tanh)
        with v1.variable_scope("d", reuse=True):
            d_fake = _dense(fake, 1, "out", tf.tanh)
        d_loss = tf.reduce_mean(d_fake) - tf.reduce_mean(d_real)
        g_loss = -tf.reduce_mean(d_fake)
        d_train = v1.train.AdamOptimizer(1e-2).minimize(
            d_loss, var_list=v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "d"))
        g_train = v1.train.AdamOptimizer(1e-2).minimize(
            g_loss, var_list=v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "g"))
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    losses = []
    for it in range(3):
        for _ in range(4):
            _, dl = sess.run([d_train, d_loss], {z: rng.randn(8, 2), real: rng.randn(8, 2) + 2})
            losses.append(dl)
        _, gl = sess.run([g_train, g_loss], {z: rng.randn(8, 2)})
        losses.append(gl)
    return _variables(sess), [float(v) for v in losses], sess


def case_monitored(session):
    """MonitoredTrainingSession with TensorFlow's own hooks (a LoggingTensorHook every 4
    steps, a StopAtStepHook), the session it makes deferred."""
    rng = np.random.RandomState(16)
    xs, ys = rng.randn(12, 4, 3).astype(np.float32), rng.randn(12, 4, 1).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(17)
        x = v1.placeholder(tf.float32, [None, 3])
        y = v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean(tf.square(_dense(x, 1, "lin") - y))
        step = v1.train.get_or_create_global_step()
        train = v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        logged = []

        class Keep(v1.train.SessionRunHook):  # the values a hook sees, as a hook reads them
            def before_run(self, run_context):
                return v1.train.SessionRunArgs(loss)

            def after_run(self, run_context, run_values):
                logged.append(run_values.results)  # kept lazily; read at the end

        hooks = [v1.train.LoggingTensorHook({"loss": loss}, every_n_iter=4), Keep()]
        final = {}

        class Final(v1.train.SessionRunHook):
            def end(self, sess):
                final.update({v.op.name: sess.run(v) for v in v1.global_variables()})

        hooks.append(Final())
        with v1.train.MonitoredTrainingSession(hooks=hooks, save_checkpoint_secs=None,
                                               save_summaries_steps=None) as mon:
            mon = session(mon)
            i = 0
            while not mon.should_stop() and i < 12:
                mon.run(train, {x: xs[i], y: ys[i]})
                i += 1
    return final, [float(v) for v in logged], mon


def case_dropout_mlp(session):
    """The commonest TF1 idiom: an MLP with dropout whose keep_prob placeholder is fed 0.8
    to train and 1.0 to evaluate, the evaluation (through the dropout's op) every 5 steps.
    The evaluations and the steps draw the dropout's one stream, as written."""
    rng = np.random.RandomState(3)
    xs, ys = rng.randn(15, 8, 6).astype(np.float32), rng.randint(0, 3, (15, 8))
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(4)
        x = v1.placeholder(tf.float32, [None, 6], "x")
        y = v1.placeholder(tf.int64, [None], "y")
        keep_prob = v1.placeholder(tf.float32, name="keep_prob")
        h = tf.nn.dropout(_dense(x, 16, "h", tf.nn.relu), rate=1 - keep_prob)
        logits = _dense(h, 3, "out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                            logits=logits))
        train = v1.train.AdamOptimizer(0.01).minimize(loss)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads = []
    for i in range(15):
        sess.run(train, {x: xs[i], y: ys[i], keep_prob: 0.8})
        if i % 5 == 4:
            reads.append(sess.run([loss, accuracy], {x: xs[0], y: ys[0], keep_prob: 1.0}))
    return _variables(sess), reads, sess


def case_gan_noise(session):
    """A GAN whose critic and generator train ops draw from one tf.random_normal: two
    critic steps and a generator step an iteration (two programs, one noise stream).
    Resource variables under both preambles: with ref variables the critic loss fetched
    beside its train op reads the weights through ``read`` Identities that alias their
    buffers, and races the in-place apply in the program as written (its first loss
    differed between two plain runs)."""
    rng = np.random.RandomState(5)
    real = rng.randn(12, 6, 2).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default(), v1.variable_scope(v1.get_variable_scope(), use_resource=True):
        v1.set_random_seed(6)
        x = v1.placeholder(tf.float32, [None, 2], "real")
        z = v1.random_normal([6, 3], seed=7)
        with v1.variable_scope("gen"):
            fake = _dense(_dense(z, 8, "l1", tf.nn.relu), 2, "out")
        with v1.variable_scope("critic") as scope:
            d_real = _dense(_dense(x, 8, "l1", tf.nn.relu), 1, "out")
            scope.reuse_variables()
            d_fake = _dense(_dense(fake, 8, "l1", tf.nn.relu), 1, "out")
        d_loss = tf.reduce_mean(d_fake) - tf.reduce_mean(d_real)
        g_loss = -tf.reduce_mean(d_fake)
        d_train = v1.train.RMSPropOptimizer(0.01).minimize(
            d_loss, var_list=v1.trainable_variables("critic"))
        g_train = v1.train.RMSPropOptimizer(0.01).minimize(
            g_loss, var_list=v1.trainable_variables("gen"))
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    losses = []
    for i in range(4):
        for k in range(2):
            losses.append(sess.run([d_train, d_loss], {x: real[3 * i + k]})[1])
        losses.append(sess.run([g_train, g_loss])[1])
    return _variables(sess), losses, sess


def case_summary_dropout(session):
    """The loss fetched every step and a summary every 3rd (two fetch sets: two
    programs, each with its copy of the step's dropout, one stream)."""
    rng = np.random.RandomState(7)
    xs = rng.randn(9, 5, 4).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(8)
        x = v1.placeholder(tf.float32, [None, 4], "x")
        h = v1.layers.dropout(_dense(x, 8, "h", tf.nn.relu), rate=0.3, training=True) \
            if hasattr(v1, "layers") and os.environ.get("TF_USE_LEGACY_KERAS") else \
            tf.nn.dropout(_dense(x, 8, "h", tf.nn.relu), rate=0.3)
        loss = tf.reduce_mean(tf.square(_dense(h, 1, "out") - 1.0))
        summary = v1.summary.scalar("loss", loss)
        train = v1.train.GradientDescentOptimizer(0.05).minimize(loss)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    reads = []
    for i in range(9):
        if i % 3 == 2:
            _, value, text = sess.run([train, loss, summary], {x: xs[i]})
            reads += [value, text]
        else:
            reads.append(sess.run([train, loss], {x: xs[i]})[1])
    return _variables(sess), reads, sess


def case_shuffle_in_step(session):
    """A step that shuffles its batch's rows (tf.random.shuffle) and adds uniform noise
    (tf.random.uniform) with graph-level seeds only, its losses read at the end."""
    rng = np.random.RandomState(9)
    xs = rng.randn(8, 6, 3).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(10)  # the ops' seeds come from the graph's alone
        x = v1.placeholder(tf.float32, [None, 3], "x")
        shuffled = tf.random.shuffle(x)
        noisy = shuffled[:4] + tf.random.uniform([4, 3], -0.1, 0.1)
        loss = tf.reduce_mean(tf.square(_dense(noisy, 1, "out") - tf.range(4.0)[:, None]))
        train = v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = v1.global_variables_initializer()
    sess = session(graph)
    sess.run(init)
    losses = [sess.run([train, loss], {x: xs[i]})[1] for i in range(8)]
    return _variables(sess), [float(v) for v in losses], sess


def _kernel_differences(session):
    """For each program the deferred session compiled: the first difference between the
    kernels its loop body executed and those of the step run alone (as written), in a
    scratch session of the graph from fresh initial values, or None where they agree."""
    from multistep.compiler import kernels

    engine = session._engine
    if not engine.programs:
        return []
    graph = next(iter(engine.programs.values())).train_op.graph
    finalized = graph.finalized  # (a MonitoredSession's: opened for the scratch initializer)
    if finalized:
        graph._unsafe_unfinalize()
    with graph.as_default():
        init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
    if finalized:
        graph.finalize()
    out = []
    for (name, links), program in engine.programs.items():
        kind = engine.canonical[name]
        feed = {k: ms.value(v) for k, v in zip(kind.keys, kind.last_feed)}
        with v1.Session(graph=graph) as scratch:
            scratch.run(init)
            _, nodes = kernels.executed(scratch, kind.flat, feed)
            single = kernels.by_name(nodes)
            _, nodes = kernels.executed(scratch, program.values,
                                        program.feed_dict(feeds=[feed] * 2))
            difference = kernels.compare(kernels.of_copies(nodes, program.name), single)
        out.append(None if difference is None else f"{program.name}: {difference}")
    return out


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def compare(name, switched=False):
    """The case as written and deferred: bitwise?, and the deferred session's report.
    ``switched``: under fuse="when_it_pays", each program's first two step runs as
    written, the rest fused (its build taken to cost nothing)."""
    fn = CASES[name]
    written_vars, written_reads, _ = fn(lambda g: v1.Session(graph=g)
                                        if isinstance(g, tf.Graph) else g)
    sessions = []

    def deferred(g):
        s = ms.deferred(v1.Session(graph=g) if isinstance(g, tf.Graph) else g, steps=STEPS,
                        fuse="when_it_pays" if switched else "at_once")
        sessions.append(s)
        return s

    saved = {k: getattr(payback, k) for k in ("build_estimate", "UNTIMED_RUNS", "TIMED_RUNS",
                                              "COMPARED_STEPS")}
    if switched:  # (and no return to as written: timings do not decide a test's counts)
        payback.build_estimate = lambda ops: 0.0
        payback.UNTIMED_RUNS, payback.TIMED_RUNS, payback.COMPARED_STEPS = 1, 1, 10**9
    try:
        vars_, reads, _ = fn(deferred)
    finally:
        for k, v in saved.items():
            setattr(payback, k, v)
    reads = ms.value(reads)
    reports = [s.report() for s in sessions]
    kernel_differences = [d for s in sessions for d in _kernel_differences(s)]
    different = [k for k in written_vars if k not in vars_ or np.asarray(
        written_vars[k]).tobytes() != np.asarray(vars_[k]).tobytes()]
    same_reads = len(reads) == len(written_reads) and all(
        type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(written_reads, reads))
    return {"case": name, "variables": len(written_vars), "different": different,
            "same_reads": same_reads, "reads": len(reads),
            "steps": sum(r.steps for r in reports), "runs": sum(r.runs for r in reports),
            "direct": sum(sum(r.direct.values()) for r in reports),
            "kernels_compared": len(kernel_differences),
            "kernel_differences": [d for d in kernel_differences if d is not None],
            "report": "\n".join(map(str, reports))}


if __name__ == "__main__":
    for name in sys.argv[2:] or sorted(CASES):
        print(json.dumps(compare(name)), flush=True)
        print(json.dumps({**compare(name, switched=True), "case": f"{name}:switched"}),
              flush=True)
