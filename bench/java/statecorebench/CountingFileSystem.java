package statecorebench;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;
import java.util.EnumSet;
import java.util.Optional;
import java.util.concurrent.ConcurrentLinkedQueue;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.util.Progressable;
import org.apache.spark.SparkContext;
import org.apache.spark.SparkContext$;
import org.apache.spark.TaskContext;

import scala.Option;

/**
 * The local file system under the scheme {@code count://}, recording every call a caller makes
 * of it (bench/spark_file_calls.py reads the records back through py4j with {@link #drain}).
 *
 * <p>A call is recorded when it comes from outside this file system: from Spark, from Hadoop's
 * FileContext, or from {@code FileSystem}'s own methods (such as {@code primitiveCreate} calling
 * {@code exists}), which an object store's file system inherits and pays for too. A call that
 * {@code RawLocalFileSystem} makes of itself to do its local job (its create's parent mkdirs)
 * is how the local disk works, not what the caller asked, and is left out.
 *
 * <p>Each record is one tab-separated line: milliseconds, the micro-batch id of the calling
 * thread (Spark's {@code streaming.sql.batchId} local property, -1 if none; only a task's and the
 * query's own thread hold a current one, as a new thread inherits its starter's), the thread's
 * name, the first Spark frame on the stack outside Spark's checkpoint file managers
 * (class.method: who asked), the call, what the path was before the call ({@code file},
 * {@code dir} or {@code missing}; for a listing, the entries listed), and the path(s).
 */
public class CountingFileSystem extends RawLocalFileSystem {
    public static final String SCHEME = "count";
    private static final URI ROOT = URI.create(SCHEME + ":///");
    private static final String BATCH_ID_KEY = "streaming.sql.batchId";
    private static final String CHECKPOINT_MANAGERS = "org.apache.spark.sql.execution.streaming.checkpointing.";
    private static final ConcurrentLinkedQueue<String> RECORDS = new ConcurrentLinkedQueue<>();
    private static final StackWalker WALKER = StackWalker.getInstance(StackWalker.Option.RETAIN_CLASS_REFERENCE);

    /** Every record since the last drain, one a line, and forget them. */
    public static String drain() {
        StringBuilder out = new StringBuilder();
        for (String line; (line = RECORDS.poll()) != null; ) {
            out.append(line).append('\n');
        }
        return out.toString();
    }

    @Override
    public URI getUri() {
        return ROOT;
    }

    @Override
    public String getScheme() {
        return SCHEME;
    }

    private static boolean calledFromRawLocal() {
        Optional<Class<?>> caller = WALKER.walk(frames -> frames
                .map(StackWalker.StackFrame::getDeclaringClass)
                .filter(c -> c != CountingFileSystem.class)
                .findFirst());
        return caller.isPresent() && caller.get().getName().startsWith(RawLocalFileSystem.class.getName());
    }

    private static String sparkFrame() {
        return WALKER.walk(frames -> frames
                .filter(f -> f.getClassName().startsWith("org.apache.spark.")
                        && !f.getClassName().startsWith(CHECKPOINT_MANAGERS))
                .map(f -> f.getClassName() + "." + f.getMethodName())
                .findFirst()
                .orElse("-"));
    }

    private static String batchId() {
        TaskContext task = TaskContext.get();
        String id = null;
        if (task != null) {
            id = task.getLocalProperty(BATCH_ID_KEY);
        } else {
            Option<SparkContext> driver = SparkContext$.MODULE$.getActive();  // the driver's threads
            if (driver.isDefined()) {
                id = driver.get().getLocalProperty(BATCH_ID_KEY);
            }
        }
        return id == null ? "-1" : id;
    }

    /** What {@code f} is on the local disk, before the call: {@code file}, {@code dir} or {@code missing}. */
    private String state(Path f) {
        java.io.File file = pathToFile(f);
        return file.isDirectory() ? "dir" : file.exists() ? "file" : "missing";
    }

    private static void record(String call, String outcome, Path... paths) {
        if (calledFromRawLocal()) {
            return;
        }
        StringBuilder line = new StringBuilder();
        line.append(System.currentTimeMillis()).append('\t').append(batchId()).append('\t')
                .append(Thread.currentThread().getName().replace('\t', ' ')).append('\t')
                .append(sparkFrame()).append('\t').append(call).append('\t').append(outcome);
        for (Path p : paths) {
            line.append('\t').append(p.toUri().getPath());
        }
        RECORDS.add(line.toString());
    }

    @Override
    public FSDataInputStream open(Path f, int bufferSize) throws IOException {
        record("open", state(f), f);
        return super.open(f, bufferSize);
    }

    @Override
    public FSDataOutputStream append(Path f, int bufferSize, Progressable progress) throws IOException {
        record("append", state(f), f);
        return super.append(f, bufferSize, progress);
    }

    @Override
    public FSDataOutputStream create(Path f, boolean overwrite, int bufferSize, short replication, long blockSize,
                                     Progressable progress) throws IOException {
        record(overwrite ? "create" : "create-no-overwrite", state(f), f);
        return super.create(f, overwrite, bufferSize, replication, blockSize, progress);
    }

    @Override
    public FSDataOutputStream create(Path f, FsPermission permission, boolean overwrite, int bufferSize,
                                     short replication, long blockSize, Progressable progress) throws IOException {
        record(overwrite ? "create" : "create-no-overwrite", state(f), f);
        return super.create(f, permission, overwrite, bufferSize, replication, blockSize, progress);
    }

    @Override
    public FSDataOutputStream createNonRecursive(Path f, FsPermission permission, EnumSet<CreateFlag> flags,
                                                 int bufferSize, short replication, long blockSize,
                                                 Progressable progress) throws IOException {
        record(flags.contains(CreateFlag.OVERWRITE) ? "create" : "create-no-overwrite", state(f), f);
        return super.createNonRecursive(f, permission, flags, bufferSize, replication, blockSize, progress);
    }

    @Override
    public FSDataOutputStream createNonRecursive(Path f, FsPermission permission, boolean overwrite, int bufferSize,
                                                 short replication, long blockSize, Progressable progress)
            throws IOException {
        record(overwrite ? "create" : "create-no-overwrite", state(f), f);
        return super.createNonRecursive(f, permission, overwrite, bufferSize, replication, blockSize, progress);
    }

    @Override
    public boolean rename(Path src, Path dst) throws IOException {
        record("rename", state(src) + "," + state(dst), src, dst);
        return super.rename(src, dst);
    }

    @Override
    public boolean delete(Path f, boolean recursive) throws IOException {
        record("delete", state(f), f);
        return super.delete(f, recursive);
    }

    @Override
    public FileStatus[] listStatus(Path f) throws IOException {
        FileStatus[] entries;
        try {
            entries = super.listStatus(f);
        } catch (IOException e) {
            record("listStatus", "missing", f);
            throw e;
        }
        record("listStatus", String.valueOf(entries.length), f);
        return entries;
    }

    @Override
    public boolean exists(Path f) throws IOException {
        record("exists", state(f), f);
        return super.exists(f);
    }

    @Override
    public boolean mkdirs(Path f) throws IOException {
        record("mkdirs", state(f), f);
        return super.mkdirs(f);
    }

    @Override
    public boolean mkdirs(Path f, FsPermission permission) throws IOException {
        record("mkdirs", state(f), f);
        return super.mkdirs(f, permission);
    }

    @Override
    public FileStatus getFileStatus(Path f) throws IOException {
        record("getFileStatus", state(f), f);
        return super.getFileStatus(f);
    }

    @Override
    public FileStatus getFileLinkStatus(Path f) throws IOException {
        record("getFileStatus", state(f), f);
        return super.getFileLinkStatus(f);
    }

    /** The same file system for Hadoop's FileContext ({@code fs.AbstractFileSystem.count.impl}), which
     * Spark's default checkpoint file manager (FileContextBasedCheckpointFileManager) asks for. */
    public static class Abstract extends DelegateToFileSystem {
        public Abstract(URI uri, Configuration conf) throws IOException, URISyntaxException {
            super(uri, new CountingFileSystem(), conf, SCHEME, false);
        }
    }
}
